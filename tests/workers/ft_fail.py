"""Worker: a replica group that always fails at start, with a Python error (for the FT launcher's give-up
test).

Group 0 fails (``FT_FAIL_GROUPS``, default ``0``); other groups sleep ``FT_OK_SLEEP`` seconds (default 3)
and exit 0, as a group that finished its training would. With ``FT_AFFINITY_DIR`` each start first writes
the CPUs it may run on to ``group<id>-start<restart>.json`` there (the ``--pin-cores`` test).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

group = os.environ.get("REPLICA_GROUP_ID", "?")
if os.environ.get("FT_AFFINITY_DIR"):
    out = Path(os.environ["FT_AFFINITY_DIR"]) / f"group{group}-start{os.environ.get('FT_RESTART_COUNT')}.json"
    out.write_text(json.dumps(sorted(os.sched_getaffinity(0))))
if group in os.environ.get("FT_FAIL_GROUPS", "0").split(","):
    print(f"group {group} start #{os.environ.get('FT_RESTART_COUNT')}: loading data", flush=True)
    print("some warning on stderr", file=sys.stderr, flush=True)
    raise RuntimeError(
        f"cannot read the dataset shard of group {group} (restart {os.environ.get('FT_RESTART_COUNT')})"
    )
time.sleep(float(os.environ.get("FT_OK_SLEEP", "3")))
print(f"group {group} done", flush=True)
