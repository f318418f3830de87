"""The SLURM scripts on a real SLURM cluster: two ``slurmd`` nodes on this machine (``tests/slurm/cluster.sh``).

Run with ``make test-slurm`` (it starts the cluster, runs ``pytest tests/slurm -m slurm`` and stops it);
without a running cluster every test here is skipped, saying so. ``make test`` leaves this folder out.
The jobs are ``examples/slurm/*.sbatch`` as shipped, with environment overrides (``GPUS_PER_NODE=2``,
``TRAIN_SCRIPT=tests/slurm/slurm_train.py``, a probe around the example's LightningCLI) and the CLI arguments of
a tiny CPU model; ``sbatch``'s own options (``--cpus-per-task``, ``--gpus-per-node=0``, ``--output``) override the
scripts' ``#SBATCH`` lines, as on any cluster. Job states come from ``scontrol show job`` (no ``sacct``
without ``slurmdbd``; the cluster keeps finished jobs for an hour).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
CONF = Path(os.environ.get("SLURM_TEST_DIR", "/var/tmp/fsdp_strategies-slurm")) / "slurm.conf"
os.environ.setdefault("SLURM_CONF", str(CONF))
TINY = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--model.vocab_size=64",
        "--data.vocab_size=64", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=32",
        "--data.seq_len=32", "--data.batch_size=4", "--data.num_train=512", "--data.num_val=8"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

pytestmark = pytest.mark.slurm


def _cluster_up() -> str | None:
    """None when the two-node cluster answers with both nodes up; else why not."""
    if shutil.which("sbatch") is None:
        return "SLURM is not installed (sbatch missing): run `make test-slurm`, which installs and starts it"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    nodes = dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())
    if out.returncode != 0 or set(nodes) != {"n1", "n2"}:
        return f"no two-node test cluster (SLURM_CONF={os.environ['SLURM_CONF']}): `make test-slurm` starts one " \
               f"({out.stderr.strip()[:200]})"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    why = _cluster_up()
    if why:
        pytest.skip(why)


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30, check=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def submit(script: str, args: list[str], *, env: dict[str, str], out: Path, sbatch: list[str] = ()) -> str:
    """``sbatch examples/slurm/SCRIPT ARGS`` from the repository root with the test's environment; the job id."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "TRAIN_SCRIPT": "tests/slurm/slurm_train.py", "SLURM_TEST_OUT": str(out / "rec"),
                **env}
    cmd = ["sbatch", "--parsable", f"--chdir={ROOT}", "--cpus-per-task=2", "--gpus-per-node=0", "--time=00:15:00",
           f"--output={out}/%x-%j.out", *sbatch, str(ROOT / "examples" / "slurm" / script), *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_job(job: str, out: Path, timeout: float = 420, restarts: int = 0) -> dict[str, str]:
    """Poll until the job is in a final state (after ``restarts`` requeues); cancel it and fail on the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job)
        if info["JobState"] in TERMINAL and int(info.get("Restarts", 0)) >= restarts:
            return info
        time.sleep(2)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} still {job_info(job)['JobState']} after {timeout} s\n{_output(out)}")


def _output(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-5000:]}" for p in sorted(out.glob("*.out")))


def records(out: Path) -> dict[str, list[dict]]:
    """``{file stem: records}`` (``rank<R>`` or ``rank<R>-group<G>``) written by ``slurm_train.py``."""
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in sorted((out / "rec").glob("*.jsonl"))}


def wait_for_step(out: Path, step: int, job: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = records(out)
        if recs and all(any(r["event"] == "step" and r["global_step"] >= step for r in rs) for rs in recs.values()):
            return
        if job_info(job)["JobState"] in TERMINAL:
            pytest.fail(f"job {job} ended before step {step}\n{_output(out)}")
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} did not reach step {step} within {timeout} s\n{_output(out)}")


def _runs(recs: list[dict]) -> list[list[dict]]:
    """One rank's records split at each ``start`` (one list per run of the job)."""
    runs: list[list[dict]] = []
    for r in recs:
        if r["event"] == "start":
            runs.append([])
        if runs:
            runs[-1].append(r)
    return runs


# ---------------------------------------------------------------------------------------- hsdp.sbatch
@pytest.mark.multiprocess
def test_hsdp_sbatch_two_nodes_shard_groups_are_the_nodes(tmp_path: Path) -> None:
    job = submit("hsdp.sbatch", ["--trainer.max_steps=20", "--trainer.enable_checkpointing=false", *TINY],
                 env={"GPUS_PER_NODE": "2", "RDZV_PORT": "29611"}, out=tmp_path)
    info = wait_job(job, tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), \
        f"{info}\n{_output(tmp_path)}"
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2"
    recs = records(tmp_path)
    assert sorted(recs) == [f"rank{r}" for r in range(4)], sorted(recs)
    node_of = {}
    for rs in recs.values():
        start = rs[0]
        assert start["event"] == "start" and start["env"]["SLURM_JOB_ID"] == job
        assert start["strategy"] == "HSDPStrategy" and start["mesh"]["names"] == ["replicate", "shard"]
        assert start["mesh"]["shape"] == [2, 2], start["mesh"]
        node_of[start["global_rank"]] = start["env"]["SLURMD_NODENAME"]
    assert sorted(node_of.values()) == ["n1", "n1", "n2", "n2"], node_of  # 2 ranks on each SLURM node
    for rs in recs.values():
        start = rs[0]
        shard, replicate = start["mesh"]["groups"]["shard"], start["mesh"]["groups"]["replicate"]
        # the shard group is exactly the ranks of this rank's node; the replicate group one rank per node
        assert shard == sorted(r for r, n in node_of.items() if n == node_of[start["global_rank"]]), (shard, node_of)
        assert sorted(node_of[r] for r in replicate) == ["n1", "n2"], (replicate, node_of)
        losses = [r["loss"] for r in rs if r["event"] == "step"]
        assert [r["global_step"] for r in rs if r["event"] == "step"] == list(range(1, 21))
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # the loss falls (ln 64 = 4.16 at the start)
        assert rs[-2]["event"] == "end" and rs[-2]["global_step"] == 20 and rs[-1]["event"] == "exit"
    # replicas (same shard position on the other node) end with identical state
    digest = {rs[0]["global_rank"]: rs[-2]["digest"] for rs in recs.values()}
    for rs in recs.values():
        replicate = rs[0]["mesh"]["groups"]["replicate"]
        assert len({digest[r] for r in replicate}) == 1, digest
    assert digest[0] != digest[1]


# ---------------------------------------------------------------------------------------- preemption
MAX_STEPS = 40
GRACE_S = 20.0  # preempt_grace_s, below the low partition's GraceTime (60 s) and torchrun's 30 s shutdown wait


def _preempt_args(ckpt: Path) -> list[str]:
    return [f"--trainer.max_steps={MAX_STEPS}", "--trainer.strategy.init_args.checkpoint_on_preempt=true",
            f"--trainer.strategy.init_args.preempt_grace_s={GRACE_S:g}", "--ckpt_path=last", *TINY]


@pytest.fixture(scope="module")
def reference_digests(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted run of the same job: every rank's final state digest."""
    out = tmp_path_factory.mktemp("reference")
    job = submit("hsdp.sbatch", _preempt_args(out / "ckpt"), out=out,
                 env={"GPUS_PER_NODE": "2", "RDZV_PORT": "29612", "SLURM_TEST_CKPT": str(out / "ckpt")})
    info = wait_job(job, out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{_output(out)}"
    ends = {rs[0]["global_rank"]: rs[-2] for rs in records(out).values()}
    assert all(e["event"] == "end" and e["global_step"] == MAX_STEPS for e in ends.values()), ends
    return {rank: e["digest"] for rank, e in ends.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["preempted_by_high_partition", "scancel_signal_term"])
def test_preempt_checkpoint_requeue_and_exact_resume(tmp_path: Path, how: str,
                                                     reference_digests: dict[int, str]) -> None:
    ckpt = tmp_path / "ckpt"
    job = submit("hsdp.sbatch", _preempt_args(ckpt), out=tmp_path, sbatch=["--partition=low"],
                 env={"GPUS_PER_NODE": "2", "RDZV_PORT": "29613", "SLURM_TEST_CKPT": str(ckpt),
                      "SLURM_TEST_STEP_SLEEP": "0.5"})
    wait_for_step(tmp_path, 5, job)
    signalled = time.time()
    high = None
    if how == "preempted_by_high_partition":  # needs both whole nodes: SLURM preempts the low-partition job
        high = subprocess.run(["sbatch", "--parsable", "--partition=high", "--nodes=2", "--exclusive",
                               f"--output={tmp_path}/high-%j.out", "--wrap", "sleep 1"],
                              capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    else:
        subprocess.run(["scancel", "--signal=TERM", job], timeout=60, check=True)
    info = wait_job(job, tmp_path, timeout=480, restarts=1)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), \
        f"{info}\n{_output(tmp_path)}"
    if high is not None:
        assert job_info(high)["JobState"] == "COMPLETED"
    output = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("hsdp-*.out"))
    # srun's status is not 75: torchrun, signalled itself, exits 1 (srun reported 1, or 143 when srun was signalled too)
    assert re.search(rf"hsdp.sbatch: the ranks were stopped by SIGTERM \(status \d+\); requeueing job {job}\n", output), \
        output[-5000:]

    recs = records(tmp_path)
    assert sorted(recs) == [f"rank{r}" for r in range(4)], sorted(recs)
    stopped_at = set()
    for name, rs in recs.items():
        first, second = _runs(rs)  # exactly two runs: the preempted one and the requeued one
        assert first[0]["env"]["SLURM_RESTART_COUNT"] in (None, "0") and first[0]["global_step"] == 0
        # every rank stopped with the preemption, at the same step, and its process exited within the grace time
        (exc,) = [r for r in first if r["event"] == "exception"]
        assert exc["type"] == "Preempted", exc
        stopped_at.add(exc["global_step"])
        exit_t = [r["t"] for r in first if r["event"] == "exit"]
        assert exit_t, f"{name}: no clean exit -- ended by the preempt_grace_s watchdog or killed\n{output[-5000:]}"
        assert exit_t[0] - signalled < GRACE_S, (name, exit_t[0] - signalled)
        assert not any(r["event"] == "end" for r in first)
        # the requeued run: same job, SLURM_RESTART_COUNT=1, resumed at the checkpointed step, ran to the end
        assert second[0]["env"]["SLURM_JOB_ID"] == job and second[0]["env"]["SLURM_RESTART_COUNT"] == "1"
        assert second[0]["global_step"] == exc["global_step"], (second[0], exc)
        steps = [r["global_step"] for r in second if r["event"] == "step"]
        assert steps == list(range(exc["global_step"] + 1, MAX_STEPS + 1)), steps
        assert second[-2]["event"] == "end" and second[-1]["event"] == "exit"
        # bit-identical final parameters and optimizer state to the uninterrupted run
        assert second[-2]["digest"] == reference_digests[second[0]["global_rank"]], name
    (step,) = stopped_at
    assert 5 <= step < MAX_STEPS
    assert (ckpt / "last-preempt.ckpt").exists(), sorted(p.name for p in ckpt.iterdir())
