"""The SLURM scripts on a real SLURM cluster: two ``slurmd`` nodes on this machine
(``tests/slurm/cluster.sh``).

Run with ``make test-slurm`` (it starts the cluster, runs ``pytest tests/slurm -m slurm`` and stops it);
without a running cluster every test here is skipped, saying so. ``make test`` leaves this folder out.
The jobs are ``examples/slurm/*.sbatch`` as shipped, with environment overrides (``GPUS_PER_NODE=2``,
``TRAIN_SCRIPT=tests/slurm/slurm_train.py``, a probe around the example's LightningCLI) and the CLI arguments
of a tiny CPU model; ``sbatch``'s own options (``--cpus-per-task``, ``--gpus-per-node=0``, ``--output``,
``--nodes``) override the scripts' ``#SBATCH`` lines, as on any cluster. ``ft_hsdp.sbatch`` runs with
``NODES_PER_GROUP=1`` (a replica group per node) and its groups' events files (``FSDP_STRATEGIES_FT_EVENTS``):
as shipped, with one group's job step SIGKILLed (restarted by the script, heals), and with
``scancel --signal=TERM`` (requeued, no group restart). ``hsdp.sbatch`` with a rank that hangs
(``HangWatchdog`` ends it with status 81): requeued without the stuck rank's node. Job states come from
``scontrol show job`` (no ``sacct`` without ``slurmdbd``; the cluster keeps finished jobs for an hour).
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
        "--data.vocab_size=64", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
        "--model.max_seq_len=32",
        "--data.seq_len=32", "--data.batch_size=4", "--data.num_train=512", "--data.num_val=8"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}

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
        return (
            f"no two-node test cluster (SLURM_CONF={os.environ['SLURM_CONF']}): `make test-slurm` starts one "
            f"({out.stderr.strip()[:200]})"
        )
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    why = _cluster_up()
    if why:
        pytest.skip(why)


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30, check=True
    )
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def submit(script: str, args: list[str], *, env: dict[str, str], out: Path, sbatch: list[str] = ()) -> str:
    """``sbatch examples/slurm/SCRIPT ARGS`` from the repository root with the test's environment; the job
    id."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "TRAIN_SCRIPT": "tests/slurm/slurm_train.py",
                "SLURM_TEST_OUT": str(out / "rec"), **env}
    cmd = ["sbatch", "--parsable", f"--chdir={ROOT}", "--cpus-per-task=2", "--gpus-per-node=0",
           "--time=00:15:00",
           f"--output={out}/%x-%j.out", *sbatch, str(ROOT / "examples" / "slurm" / script), *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_job(job: str, out: Path, timeout: float = 420, restarts: int = 0) -> dict[str, str]:
    """Poll until the job is in a final state (after ``restarts`` requeues); cancel it and fail on the
    timeout."""
    deadline = time.monotonic() + timeout
    ended = None  # since when the job is in a final state without the requeues expected
    while time.monotonic() < deadline:
        info = job_info(job)
        if info["JobState"] in TERMINAL and int(info.get("Restarts", 0)) >= restarts:
            return info
        if info["JobState"] in TERMINAL:  # a requeue leaves the final state within a second: fail fast
            ended = ended or time.monotonic()
            if time.monotonic() - ended > 20:
                pytest.fail(
                    f"job {job} ended {info['JobState']} without being requeued ({restarts} expected)\n"
                    f"{info}\n{_output(out)}"
                )
        else:
            ended = None
        time.sleep(2)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} still {job_info(job)['JobState']} after {timeout} s\n{_output(out)}")


def _output(out: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-5000:]}" for p in sorted(out.glob("*.out"))
    )


def records(out: Path) -> dict[str, list[dict]]:
    """``{file stem: records}`` (``rank<R>`` or ``rank<R>-group<G>``) written by ``slurm_train.py``."""
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in sorted((out / "rec").glob("*.jsonl"))}


def wait_for_step(out: Path, step: int, job: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = records(out)
        if recs and all(
            any(r["event"] == "step" and r["global_step"] >= step for r in rs) for rs in recs.values()
        ):
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
        assert shard == sorted(r for r, n in node_of.items() if n == node_of[start["global_rank"]]), (
            shard,
            node_of,
        )
        assert sorted(node_of[r] for r in replicate) == ["n1", "n2"], (replicate, node_of)
        losses = [r["loss"] for r in rs if r["event"] == "step"]
        assert [r["global_step"] for r in rs if r["event"] == "step"] == list(range(1, 21))
        # the loss falls (ln 64 = 4.16 at the start)
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
        assert rs[-2]["event"] == "end" and rs[-2]["global_step"] == 20 and rs[-1]["event"] == "exit"
    # replicas (same shard position on the other node) end with identical state
    digest = {rs[0]["global_rank"]: rs[-2]["digest"] for rs in recs.values()}
    for rs in recs.values():
        replicate = rs[0]["mesh"]["groups"]["replicate"]
        assert len({digest[r] for r in replicate}) == 1, digest
    assert digest[0] != digest[1]


# ---------------------------------------------------------------------------------------- preemption
MAX_STEPS = 40
# preempt_grace_s, below the low partition's GraceTime (60 s) and torchrun's 30 s shutdown wait
GRACE_S = 20.0


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
    # srun's status is not 75: torchrun, signalled itself, exits 1 (srun reported 1, or 143 when srun was
    # signalled too)
    assert re.search(
        rf"hsdp.sbatch: the ranks were stopped by SIGTERM \(status \d+\); requeueing job {job}\n", output
    ), output[-5000:]

    recs = records(tmp_path)
    assert sorted(recs) == [f"rank{r}" for r in range(4)], sorted(recs)
    stopped_at = set()
    for name, rs in recs.items():
        first, second = _runs(rs)  # exactly two runs: the preempted one and the requeued one
        assert first[0]["env"]["SLURM_RESTART_COUNT"] in (None, "0") and first[0]["global_step"] == 0
        # every rank stopped with the preemption, at the same step, and its process exited within the grace
        # time
        (exc,) = [r for r in first if r["event"] == "exception"]
        assert exc["type"] == "Preempted", exc
        stopped_at.add(exc["global_step"])
        exit_t = [r["t"] for r in first if r["event"] == "exit"]
        assert exit_t, (
            f"{name}: no clean exit -- ended by the preempt_grace_s watchdog or killed\n{output[-5000:]}"
        )
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


# ---------------------------------------------------------------------------------------- a hang
@pytest.mark.multiprocess
def test_hang_exits_81_and_the_job_is_requeued_without_the_stuck_node(tmp_path: Path) -> None:
    # Global rank 3 sleeps forever when it starts step 5 (first run only). HangWatchdog (timeout_s 10) names
    # it and its SLURM node, every rank exits 81, and hsdp.sbatch requeues the job with that node excluded. A
    # 2-node job without one of this cluster's 2 nodes cannot start again: it stays pending (as far as one
    # host shows it).
    job = submit("hsdp.sbatch", ["--trainer.max_steps=40", "--trainer.enable_checkpointing=false", *TINY],
                 env={"GPUS_PER_NODE": "2", "RDZV_PORT": "29614", "SLURM_TEST_HANG": "3:5:10"}, out=tmp_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        info = job_info(job)
        if int(info.get("Restarts", 0)) >= 1 and info["JobState"] == "PENDING":
            break
        if info["JobState"] in TERMINAL:
            pytest.fail(f"job {job} ended {info['JobState']} instead of being requeued\n{info}\n"
                        f"{_output(tmp_path)}")
        time.sleep(2)
    else:
        subprocess.run(["scancel", job], timeout=30)
        pytest.fail(f"job {job} was not requeued within 300 s\n{_output(tmp_path)}")
    subprocess.run(["scancel", job], timeout=30, check=True)
    node = {rs[0]["global_rank"]: rs[0]["env"]["SLURMD_NODENAME"] for rs in records(tmp_path).values()}[3]
    assert info["ExcNodeList"] == node, (info, node)
    output = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("hsdp-*.out"))
    assert output.count("exiting with status 81 (hang)") == 4, output[-5000:]
    assert f"hsdp.sbatch: HangWatchdog stopped the job (status 81): hang: rank 3 (host {node}) stuck in " \
        "forward at step 5" in output, output[-5000:]
    assert f"hsdp.sbatch: requeueing job {job} without node(s) {node}\n" in output, output[-5000:]
    assert "in hang_forever" in (tmp_path / "rec" / "hang" / "rank3-stacks.txt").read_text()


# ---------------------------------------------------------------------------------------- ft_hsdp.sbatch
# 2 nodes, NODES_PER_GROUP=1: the lighthouse on n1, replica group 0 on n1 and group 1 on n2, 2 ranks each
FT_ENV = {"GPUS_PER_NODE": "2", "NODES_PER_GROUP": "1", "HEARTBEAT_TIMEOUT_MS": "2000"}
FT_ARGS = ["--trainer.strategy.init_args.timeout_s=10", "--trainer.strategy.init_args.connect_timeout_s=10",
           "--trainer.strategy.init_args.quorum_timeout_s=60", *TINY]


def _ft_submit(out: Path, ports: int, args: list[str], env: dict[str, str] = {}) -> str:  # noqa: B006
    """``ft_hsdp.sbatch`` on both nodes; rendezvous ports ``ports``, ``ports + 1``, the lighthouse
    ``ports + 9``."""
    return submit("ft_hsdp.sbatch", [*args, *FT_ARGS], out=out, sbatch=["--nodes=2"],
                  env={**FT_ENV, "RDZV_PORT": str(ports), "LIGHTHOUSE_PORT": str(ports + 9),
                       "FSDP_STRATEGIES_FT_EVENTS": str(out / "events" / "group{replica_group_id}.jsonl"),
                       **env})


def events(out: Path, group: int) -> list[dict]:
    """Group ``group``'s events file (its rank 0 writes a line per step, every run of the group appends)."""
    path = out / "events" / f"group{group}.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def _ft_output(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(out.glob("ft_hsdp-*.out")))


def _check_ft_starts(recs: dict[str, list[dict]], job: str, lighthouse_port: int) -> None:
    """Every rank of both groups ran where the script says: group g on node n<g+1>, the lighthouse on n1."""
    assert sorted(recs) == [f"rank{r}-group{g}" for r in (0, 1) for g in (0, 1)], sorted(recs)
    for name, rs in recs.items():
        group = int(name.rsplit("group", 1)[1])
        env = rs[0]["env"]
        assert rs[0]["event"] == "start" and rs[0]["strategy"] == "FTHSDPStrategy", rs[0]
        assert (env["SLURM_JOB_ID"], env["SLURMD_NODENAME"], env["REPLICA_GROUP_ID"]) == (job,
                                                                                          f"n{group + 1}",
                                                                                         str(group)), env
        assert (env["NUM_REPLICA_GROUPS"], env["TORCHFT_LIGHTHOUSE"]) == (
            "2",
            f"http://n1:{lighthouse_port}",
        ), env
        assert rs[0]["mesh"]["shape"] == [2], rs[0]["mesh"]  # FSDP2 over the group's 2 ranks


def _committed(evs: list[dict]) -> list[int]:
    return [e["step"] for e in evs if e.get("committed") and "step" in e]


@pytest.mark.multiprocess
def test_ft_hsdp_job_lighthouse_and_two_replica_groups(tmp_path: Path) -> None:
    steps = 20
    job = _ft_submit(
        tmp_path, 29620, [f"--trainer.max_steps={steps}", "--trainer.enable_checkpointing=false"]
    )
    info = wait_job(job, tmp_path)
    output = _ft_output(tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        f"{info}\n{output}"
    )
    assert info["NodeList"] == "n[1-2]" and "restart" not in output, output[-5000:]
    recs = records(tmp_path)
    _check_ft_starts(recs, job, 29629)
    for name, rs in recs.items():
        step_recs = [r for r in rs if r["event"] == "step"]
        assert [r["global_step"] for r in step_recs] == list(range(1, steps + 1)), name
        assert all(r["committed"] and r["participants"] == 2 for r in step_recs), (name, step_recs)
        losses = [r["loss"] for r in step_recs]
        # the loss falls (ln 64 = 4.16 at first)
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
        assert rs[-2]["event"] == "end" and rs[-2]["global_step"] == steps and rs[-1]["event"] == "exit"
    # the groups committed the same steps, and torchft's averaging left them with the same state
    committed = [_committed(events(tmp_path, g)) for g in (0, 1)]
    assert committed[0] == committed[1] and committed[0][-1] == steps, committed
    for rank in (0, 1):
        assert recs[f"rank{rank}-group0"][-2]["digest"] == recs[f"rank{rank}-group1"][-2]["digest"]


def _group_step(job: str, node: str) -> str:
    """The id (JOB.STEP) of the running replica group step (torchrun) on ``node``."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j %N"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    (step,) = [line.split()[0] for line in out.splitlines() if line.split()[1:] == ["torchrun", node]]
    return step


@pytest.mark.multiprocess
def test_ft_hsdp_job_group_step_killed_restarts_and_heals(tmp_path: Path) -> None:
    steps = 40  # 1 s per step: group 0 trains ~30 s alone, the restart took 12-15 s here
    job = _ft_submit(tmp_path, 29640,
                     [f"--trainer.max_steps={steps}", "--trainer.enable_checkpointing=false"],
                     env={"SLURM_TEST_STEP_SLEEP": "1"})
    wait_for_step(tmp_path, 5, job)
    step = _group_step(job, "n2")
    subprocess.run(["scancel", "--signal=KILL", step], timeout=60, check=True)  # group 1's node step: SIGKILL
    killed = time.time()
    info = wait_job(job, tmp_path)
    output = _ft_output(tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        f"{info}\n{output}"
    )
    assert "ft_hsdp.sbatch: replica group 1 failed; restart 1 of 3." in output, output[-5000:]
    assert "replica group 0 failed" not in output and "requeue" not in output, output[-5000:]

    recs = records(tmp_path)
    _check_ft_starts(recs, job, 29649)
    ev0, ev1 = events(tmp_path, 0), events(tmp_path, 1)
    # group 0 kept committing while group 1 was down (alone: 1 participant), without a restart of its own
    assert all(len(_runs(recs[f"rank{r}-group0"])) == 1 for r in (0, 1))
    alone = [e["step"] for e in ev0 if e.get("committed") and e["participants"] == 1 and e["t"] > killed]
    assert len(alone) >= 3, ev0
    for rank in (0, 1):
        first, second = _runs(recs[f"rank{rank}-group1"])
        # the killed run: SIGKILLed (no exit record), no step after the kill
        assert first[-1]["event"] == "step" and first[-1]["t"] < killed + 1, first[-3:]
        # the restarted run: same job, same node, healed from group 0 and ran with it to the end
        assert second[0]["env"]["SLURMD_NODENAME"] == "n2" and second[0]["env"]["SLURM_JOB_ID"] == job
        heals = [r for r in second if r["event"] == "step" and r.get("heals")]
        assert heals and heals[0]["global_step"] > alone[0], (heals[:1], alone[:3])
        assert second[-2]["event"] == "end" and second[-2]["global_step"] == steps
        assert recs[f"rank{rank}-group0"][-2]["global_step"] == steps
        assert second[-2]["digest"] == recs[f"rank{rank}-group0"][-2]["digest"]  # identical at the end
    # (its first run healed too, at step 1: init_sync copies one group's weights to the others)
    healed = [i for i, e in enumerate(ev1) if e.get("healed") and e["t"] > killed]
    assert healed and ev1[healed[0]]["step"] > alone[0], ev1[-5:]
    # the healing step counts group 0 alone (the healing group gets the state, contributes nothing); then both
    assert all(e["participants"] == 2 for e in ev1[healed[0] + 1:] if "step" in e), ev1[healed[0]:]
    assert _committed(ev0)[-1] == _committed(ev1)[-1] == steps
    # group 1 missed the steps group 0 committed alone (which group commits step 1 and which heals into it
    # depends on which started first: CI #4, with other tests running beside, saw group 0 heal at step 1)
    assert set(_committed(ev1)) - {1} < set(_committed(ev0))


@pytest.mark.multiprocess
def test_ft_hsdp_job_sigterm_requeues_without_group_restart(tmp_path: Path) -> None:
    steps, ckpt = 30, tmp_path / "ckpt"
    job = _ft_submit(tmp_path, 29660, [f"--trainer.max_steps={steps}",
                                       "--trainer.strategy.init_args.checkpoint_on_preempt=true",
                                       f"--trainer.strategy.init_args.preempt_grace_s={GRACE_S:g}",
                                       "--ckpt_path=last"],
                     env={"SLURM_TEST_CKPT": str(ckpt), "SLURM_TEST_STEP_SLEEP": "0.5"})
    wait_for_step(tmp_path, 5, job)
    subprocess.run(["scancel", "--signal=TERM", job], timeout=60, check=True)
    info = wait_job(job, tmp_path, timeout=480, restarts=1)
    output = _ft_output(tmp_path)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), (
        f"{info}\n{output}"
    )
    # the groups were not started again after the SIGTERM: the job was requeued instead
    assert "restart 1 of" not in output, output[-5000:]
    assert f"ft_hsdp.sbatch: the replica groups were stopped by SIGTERM; requeueing job {job}\n" in output, (
        output[-5000:]
    )
    recs = records(tmp_path)
    assert sorted(recs) == [f"rank{r}-group{g}" for r in (0, 1) for g in (0, 1)], sorted(recs)
    for name, rs in recs.items():
        first, second = _runs(rs)  # exactly two runs: the signalled one and the requeued one
        assert first[0]["env"]["SLURM_RESTART_COUNT"] in (None, "0")
        (exc,) = [r for r in first if r["event"] == "exception"]
        assert exc["type"] == "Preempted" and [r for r in first if r["event"] == "exit"], (name, first[-3:])
        assert second[0]["env"]["SLURM_RESTART_COUNT"] == "1" and second[0]["env"]["SLURM_JOB_ID"] == job
        # resumed from a preemption checkpoint (--ckpt_path last)
        assert second[0]["global_step"] > 0, second[0]
        assert second[-2]["event"] == "end" and second[-2]["global_step"] == steps, (name, second[-3:])
    assert sorted(p.name for p in ckpt.glob("last-preempt-group*.ckpt")) == \
        ["last-preempt-group0.ckpt", "last-preempt-group1.ckpt"], sorted(p.name for p in ckpt.iterdir())
    for rank in (0, 1):
        assert recs[f"rank{rank}-group0"][-2]["digest"] == recs[f"rank{rank}-group1"][-2]["digest"]
