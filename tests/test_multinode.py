"""Multiple nodes, simulated on one machine: two ``torchrun`` agents (one per "node") on 127.0.0.1.

Each agent joins a ``c10d`` rendezvous with ``--nnodes=2`` and starts its own ranks, exactly as one
agent per node does on a cluster (the lines come from ``tests/support/multinode.py``); ``MN_AGENT`` in an
agent's environment names its node, as a hostname would. Checked:

* ``hsdp`` with both degrees ``auto`` (2 agents x 2 ranks): mesh replicate 2 x shard 2, every shard
  group = the ranks of one node, every replicate group = one rank per node, and replicas on the two
  nodes hold bit-identical shards after every step (the cross-node all-reduce ran);
* ``ddp_hooks`` ``hierarchical_sgd`` with its default levels, in the same processes: ``{period:
  ranks of one node, 4 x period: all ranks}``, torch's averaging subgroups = the nodes, and the
  parameters follow that schedule (equal within a node after a node-level averaging, everywhere
  after the global one, different before);
* ``ft_hsdp``: one replica group spanning both nodes (2 agents x 1 rank) with a ``torchft_lighthouse``
  started as its own process, as the SLURM script's lighthouse step: its mesh is the two nodes'
  ranks, and every step commits.

``examples/slurm/*.sbatch`` are rendered with stub ``srun``/``scontrol``/``torchrun``/
``torchft_lighthouse`` commands that record their arguments: the scripts must run the same torchrun
and lighthouse lines as the local runs above (same builder, the SLURM variables filled in).

``make test-full`` (the ``full`` marker, its own CI stage) adds an ``ft_hsdp`` run with two replica groups,
each spanning two agents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, _env, as_torchrun_rank0, free_port
from fsdp_strategies.ft.protocol import EventLog
from support.multinode import (
    ft_hsdp_script_args,
    hsdp_script_args,
    lighthouse_args,
    run_agents,
    start_lighthouse,
    torchrun_args,
)

WORKER = str(WORKERS / "multinode_train.py")
SLURM = ROOT / "examples" / "slurm"
TINY = ["--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", "--model.vocab_size=64", "--data.vocab_size=64",
        "--model.dim=64",
        "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=32", "--data.seq_len=32",
        "--data.batch_size=2", "--data.num_train=64", "--data.num_val=8"]
# ddp_hooks in the same processes after hsdp: default hierarchy levels, no gradient all-reduce after a
# 2-step warm-up (local_group_size 1), so only the averagings make parameters equal across ranks
DDP_AFTER_HSDP = ["::", "fit", "--config", "configs/ddp_hooks_hierarchical_sgd.yaml", "--trainer.num_nodes=2",
                  "--trainer.devices=2", "--trainer.strategy.init_args.hierarchy_levels=null",
                  "--trainer.strategy.init_args.local_sgd_period=2",
                  "--trainer.strategy.init_args.local_sgd_warmup=2",
                  "--trainer.strategy.init_args.local_group_size=1", "--trainer.max_steps=9", *TINY]
HSDP_EXTRA = ["--trainer.max_steps=4", *TINY, *DDP_AFTER_HSDP]
FT_EXTRA = ["--trainer.max_steps=4", "--trainer.strategy.init_args.timeout_s=30",
            "--trainer.strategy.init_args.connect_timeout_s=10", *TINY]
HEARTBEAT_MS = 1000


def hsdp_agent_args(*, rdzv_endpoint: str, rdzv_id: str, script: str = WORKER) -> list[str]:
    """One agent of the local 2 x 2 run -- and what hsdp.sbatch must run on a node of a 2-node, 2-GPU job."""
    return torchrun_args(nnodes=2, nproc_per_node=2, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                         script=script, script_args=hsdp_script_args("configs/hsdp.yaml", nnodes=2, devices=2,
                                                      extra=HSDP_EXTRA))


def ft_agent_args(*, rdzv_endpoint: str, rdzv_id: str, script: str = WORKER) -> list[str]:
    """One agent of a replica group of 2 nodes x 1 rank (local run and ft_hsdp.sbatch with 1 GPU per node)."""
    return torchrun_args(nnodes=2, nproc_per_node=1, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                         script=script,
                         script_args=ft_hsdp_script_args("configs/ft_hsdp.yaml", nnodes=2, devices=1,
                                                         extra=FT_EXTRA))


# ---------------------------------------------------------------------------- local two-agent runs
def _agent_env(extra: dict[str, str]) -> dict[str, str]:
    env = _env(extra)
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # the rendezvous sets them for the workers
        env.pop(key, None)
    return env


def _logs(out: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in sorted((out / "logs").glob("*.log"))
    )


def _records(out: Path, fit: int, world: int) -> list[dict]:
    return [json.loads((out / f"{fit}_rank{rank}.json").read_text()) for rank in range(world)]


def _check_topology(records: list[dict], nodes: int, per_node: int) -> dict[int, str]:
    """torchrun's and Lightning's view agree; each node holds a contiguous block of ranks. Returns rank ->
    node."""
    node_of = {}
    for rank, rec in enumerate(records):
        env, lit = rec["env"], rec["lightning"]
        assert int(env["RANK"]) == lit["global_rank"] == rank
        assert (int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_WORLD_SIZE"])) == \
            (nodes * per_node, per_node, nodes)
        assert (lit["num_nodes"], lit["num_devices"], lit["world_size"]) == (
            nodes,
            per_node,
            nodes * per_node,
        )
        assert lit["node_rank"] == int(env["GROUP_RANK"]) and lit["local_rank"] == int(env["LOCAL_RANK"])
        # not SLURM's, even with SLURM_* set
        assert lit["cluster_environment"] == "TorchElasticEnvironment", lit
        node_of[rank] = env["MN_AGENT"]
    for node in set(node_of.values()):
        ranks = sorted(r for r, n in node_of.items() if n == node)
        assert len(ranks) == per_node and ranks == list(range(ranks[0], ranks[0] + per_node)), node_of
    return node_of


@pytest.mark.multiprocess
def test_two_nodes_hsdp_auto_degrees_then_hierarchical_sgd_levels(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [hsdp_agent_args(rdzv_endpoint=endpoint, rdzv_id="mn-hsdp")] * 2
    # what srun gives each task (one per node): Lightning must still take the ranks from torchrun
    slurm = [{"SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_PROCID": str(i), "SLURM_NODEID": str(i),
              "SLURM_LOCALID": "0", "SLURM_JOB_NAME": "hsdp", "SLURM_JOB_ID": "4242"} for i in range(2)]
    try:
        codes = run_agents(agents, env=_agent_env({"MN_OUT": str(tmp_path)}), log_dir=tmp_path / "logs",
                           timeout=400, agent_env=[{"MN_AGENT": f"node{i}", **slurm[i]} for i in range(2)])
    except TimeoutError as err:
        pytest.fail(f"{err}\n{_logs(tmp_path)}")
    assert codes == [0, 0], f"agents exited {codes}\n{_logs(tmp_path)}"

    # hsdp, replicate_degree = shard_degree = auto
    hsdp = _records(tmp_path, 0, 4)
    node_of = _check_topology(hsdp, nodes=2, per_node=2)
    for rank, rec in enumerate(hsdp):
        assert rec["strategy"] == "HSDPStrategy"
        assert rec["mesh"]["names"] == ["replicate", "shard"] and rec["mesh"]["shape"] == [2, 2], rec["mesh"]
        shard, replicate = rec["mesh"]["groups"]["shard"], rec["mesh"]["groups"]["replicate"]
        assert shard == sorted(r for r, n in node_of.items() if n == node_of[rank]), (rank, shard, node_of)
        assert len(replicate) == 2 and {node_of[r] for r in replicate} == set(node_of.values()), (
            rank,
            replicate,
        )
        assert rec["param"]["placements"] == ["R", "S(0)"]
        assert rec["param"]["local"][0] * 2 == rec["param"]["full"][0]  # sharded in two within the node
        assert [s["global_step"] for s in rec["steps"]] == [1, 2, 3, 4]
    for rank, rec in enumerate(hsdp):  # the replica on the other node holds the same shard after every step
        peer = next(r for r in rec["mesh"]["groups"]["replicate"] if r != rank)
        assert [s["params"] for s in rec["steps"]] == [s["params"] for s in hsdp[peer]["steps"]], (rank, peer)
        other_shard = next(r for r in rec["mesh"]["groups"]["shard"] if r != rank)
        assert rec["steps"][-1]["params"] != hsdp[other_shard]["steps"][-1]["params"]

    # ddp_hooks hierarchical_sgd, default levels: {local_sgd_period: one node, 4 x period: the world}
    ddp = _records(tmp_path, 1, 4)
    assert _check_topology(ddp, nodes=2, per_node=2) == node_of
    for rank, rec in enumerate(ddp):
        assert rec["strategy"] == "DDPHooksStrategy"
        assert rec["hierarchy_levels"] == {"2": 2, "8": 4}, rec["hierarchy_levels"]
        assert rec["averager_groups"]["2"] == sorted(r for r, n in node_of.items() if n == node_of[rank])
        assert rec["averager_groups"]["8"] == [0, 1, 2, 3]
    by_step = [[rec["steps"][i]["params"] for rec in ddp] for i in range(9)]
    nodes = sorted(set(node_of.values()))
    groups = [[r for r in range(4) if node_of[r] == n] for n in nodes]

    def pattern(digests: list[str]) -> str:
        if len(set(digests)) == 1:
            return "all"
        if all(len({digests[r] for r in g}) == 1 for g in groups):
            return "node"
        return "none" if len(set(digests)) == 4 else "other"

    # torch's HierarchicalModelAverager: after the warm-up (2 steps, gradients all-reduced), its step
    # counter s = global_step - 1 averages over the largest period dividing s: 2 -> node, 8 -> all
    assert [pattern(d) for d in by_step] == ["all", "all", "node", "none", "node", "none", "node", "none",
                                             "all"], \
        by_step


def _run_ft_groups(out: Path, groups: int) -> list[list[dict]]:
    port = free_port()
    (out / "logs").mkdir(parents=True)
    lighthouse = start_lighthouse(port=port, min_replicas=groups, heartbeat_timeout_ms=HEARTBEAT_MS,
                                  log=out / "logs" / "lighthouse.log")
    try:
        agents, envs = [], []
        for group in range(groups):
            endpoint = f"127.0.0.1:{free_port()}"
            for node in range(2):
                agents.append(ft_agent_args(rdzv_endpoint=endpoint, rdzv_id=f"mn-ft-group{group}"))
                envs.append({"MN_AGENT": f"node{2 * group + node}", "REPLICA_GROUP_ID": str(group),
                             "MN_OUT": str(out / f"group{group}")})
        env = _agent_env(
            {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "NUM_REPLICA_GROUPS": str(groups)}
        )
        try:
            codes = run_agents(agents, env=env, log_dir=out / "logs", timeout=400, agent_env=envs)
        except TimeoutError as err:
            pytest.fail(f"{err}\n{_logs(out)}")
        assert codes == [0] * len(agents), f"agents exited {codes}\n{_logs(out)}"
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return [_records(out / f"group{group}", 0, 2) for group in range(groups)]


def _check_ft_group(records: list[dict], group: int, groups: int) -> None:
    node_of = _check_topology(records, nodes=2, per_node=1)
    assert len(set(node_of.values())) == 2  # the group spans two nodes
    for rec in records:
        assert rec["strategy"] == "FTHSDPStrategy"
        assert (rec["replica_group_id"], rec["num_replica_groups"]) == (group, groups)
        assert rec["mesh"] == {"names": ["shard"], "shape": [2], "groups": {"shard": [0, 1]}}, rec["mesh"]
        assert (
            rec["param"]["placements"] == ["S(0)"] and rec["param"]["local"][0] * 2 == rec["param"]["full"][0]
        )
        assert [(s["global_step"], s["committed"], s["participants"]) for s in rec["steps"]] == \
            [(step, True, groups) for step in (1, 2, 3, 4)], rec["steps"]


@pytest.mark.multiprocess
def test_ft_hsdp_replica_group_spanning_two_nodes(tmp_path: Path) -> None:
    (group,) = _run_ft_groups(tmp_path, groups=1)
    _check_ft_group(group, 0, 1)


@pytest.mark.multiprocess
@pytest.mark.full
def test_ft_hsdp_two_replica_groups_of_two_nodes_each(tmp_path: Path) -> None:
    groups = _run_ft_groups(tmp_path, groups=2)
    for gid, records in enumerate(groups):
        _check_ft_group(records, gid, 2)
    for rank in range(2):  # torchft averaged across the groups: same shards on both groups after every step
        assert [s["params"] for s in groups[0][rank]["steps"]] == [
            s["params"] for s in groups[1][rank]["steps"]
        ]


# ---------------------------------------------------------------------------- the SLURM scripts, rendered
_SRUN = r'''
import json, os, subprocess, sys
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    key, eq, value = args.pop(0).partition("=")
    opts[key] = value if eq else True
nodes = opts["--nodelist"].split(",") if "--nodelist" in opts else \
    os.environ["STUB_NODES"].split()[: int(opts["--nodes"])]
with open(os.environ["STUB_LOG"], "a") as fh:
    fh.write(json.dumps({"tool": "srun", "opts": opts, "cmd": args, "nodes": nodes}) + "\n")
if len(nodes) == 1:
    os.execvpe(args[0], args, {**os.environ, "SLURMD_NODENAME": nodes[0]})
procs = [subprocess.Popen(args, env={**os.environ, "SLURMD_NODENAME": n}) for n in nodes]
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
'''
_SCONTROL = r'''
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as fh:
    fh.write(json.dumps({"tool": "scontrol", "argv": sys.argv[1:]}) + "\n")
if sys.argv[1:3] == ["show", "job"]:  # the scripts' preemption checks: a running job, never preempted
    print(f"JobId={sys.argv[3]} JobState=RUNNING PreemptTime=None\n   StdOut=/dev/null")
    sys.exit(0)
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(os.environ["STUB_NODES"].split()))
'''
_TORCHRUN = r'''
import json, os, sys
keys = ("SLURMD_NODENAME", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE",
        "FSDP_STRATEGIES_FT_EVENTS")
with open(os.environ["STUB_LOG"], "a") as fh:
    fh.write(json.dumps({"tool": "torchrun", "argv": sys.argv[1:],
                         **{k: os.environ.get(k) for k in keys}}) + "\n")
fail = os.environ.get("STUB_FAIL_GROUP_ONCE")
if fail is not None and os.environ.get("REPLICA_GROUP_ID") == fail:
    try:  # one agent of that group's first attempt fails (a lost node)
        os.close(os.open(os.environ["STUB_LOG"] + ".failed", os.O_CREAT | os.O_EXCL))
        sys.exit(1)
    except FileExistsError:
        pass
'''
_LIGHTHOUSE = r'''
import json, os, socket, sys, time
with open(os.environ["STUB_LOG"], "a") as fh:
    fh.write(json.dumps({"tool": "torchft_lighthouse", "argv": sys.argv[1:], "pid": os.getpid(),
                         "SLURMD_NODENAME": os.environ.get("SLURMD_NODENAME")}) + "\n")
time.sleep(1.0)  # the script must wait until the lighthouse listens
port = int(next(a for a in sys.argv if a.startswith("--bind=")).rsplit(":", 1)[1])
server = socket.create_server(("0.0.0.0", port))
while True:
    server.accept()[0].close()
'''


def _render(
    tmp: Path, script: str, args: Sequence[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """Run ``examples/slurm/SCRIPT`` as sbatch would, with stubs for the SLURM and torch commands."""
    stubs = tmp / "bin"
    stubs.mkdir(parents=True, exist_ok=True)
    for name, body in (("srun", _SRUN), ("scontrol", _SCONTROL), ("torchrun", _TORCHRUN),
                       ("torchft_lighthouse", _LIGHTHOUSE)):
        (stubs / name).write_text(f"#!{sys.executable}\n{body}")
        (stubs / name).chmod(0o755)
    log = tmp / f"{script}.calls.jsonl"
    base = {k: v for k,
            v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE", "CONFIG", "TRAIN_SCRIPT",
                                                                      "NODES_PER_GROUP", "TORCHFT_",
                                                                      "REPLICA_GROUP", "NUM_REPLICA_GROUPS"))}
    full_env = {**base, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-4]", **env}
    proc = subprocess.run(["bash", str(SLURM / script), *args], env=full_env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def _tool(calls: list[dict], tool: str) -> list[dict]:
    return [c for c in calls if c["tool"] == tool]


@pytest.mark.multiprocess
def test_slurm_hsdp_script_runs_the_local_two_agent_lines(tmp_path: Path) -> None:
    nodes = "127.0.0.1 127.0.0.2"
    env = {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_PER_TASK": "6", "STUB_NODES": nodes,
           "TRAIN_SCRIPT": WORKER}
    proc, calls = _render(tmp_path, "hsdp.sbatch", HSDP_EXTRA, env)
    assert proc.returncode == 0, proc.stderr
    (srun,) = _tool(calls, "srun")
    assert srun["nodes"] == nodes.split() and srun["opts"]["--ntasks-per-node"] == "1"
    assert srun["opts"]["--cpus-per-task"] == "6"  # the node's CPUs go to the agent and its ranks
    runs = _tool(calls, "torchrun")
    assert sorted(r["SLURMD_NODENAME"] for r in runs) == nodes.split()  # one agent per node
    expected = hsdp_agent_args(rdzv_endpoint="127.0.0.1:29500", rdzv_id="4242")  # the first node, the job id
    for run in runs:
        assert run["argv"] == expected, (run["argv"], expected)

    # defaults: the example script and configs/hsdp.yaml, GPUs per node from SLURM, no extra arguments
    proc, calls = _render(tmp_path / "defaults", "hsdp.sbatch", [],
                          {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8",
                                                                    "STUB_NODES": "gpu-a gpu-b"})
    assert proc.returncode == 0, proc.stderr
    assert [r["argv"] for r in _tool(calls, "torchrun")] == [torchrun_args(
        nnodes=2, nproc_per_node=8, rdzv_endpoint="gpu-a:29500", rdzv_id="4242",
        script="examples/train_llama.py",
        script_args=hsdp_script_args("configs/hsdp.yaml", nnodes=2, devices=8))] * 2


@pytest.mark.multiprocess
def test_slurm_ft_hsdp_script_lighthouse_step_groups_and_restart(tmp_path: Path) -> None:
    nodes = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = free_port()
    # the groups' events as a run that went down after step 5 left them: group 0 wrote checkpoints at steps 2
    # and 4, group 1 committed step 5; group 0's (stub) step is not ahead of group 1 when group 1 restarts
    events_dir = tmp_path / "events"
    EventLog(events_dir / "group0.jsonl").write_checkpoint(0, 2, "/ckpt/step2.ckpt")
    EventLog(events_dir / "group0.jsonl").write_checkpoint(0, 4, "/ckpt/step4.ckpt")
    EventLog(events_dir / "group1.jsonl").write_step(1, 5, True)
    env = {"SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "1", "STUB_NODES": " ".join(nodes),
           "TRAIN_SCRIPT": WORKER,
           "NODES_PER_GROUP": "2", "LIGHTHOUSE_PORT": str(port), "HEARTBEAT_TIMEOUT_MS": str(HEARTBEAT_MS),
           "MAX_RESTARTS": "1", "STUB_FAIL_GROUP_ONCE": "1", "FT_EVENTS_DIR": str(events_dir),
           "PYTHON": sys.executable}
    proc, calls = _render(tmp_path, "ft_hsdp.sbatch", FT_EXTRA, env)
    assert proc.returncode == 0, proc.stderr
    # the restarted group 1 was handed the recorded checkpoints, newest first (only group 1, on its restart)
    assert (events_dir / "group1.resume").read_text() == "/ckpt/step4.ckpt\n/ckpt/step2.ckpt\n"
    assert not (events_dir / "group0.resume").exists() and not list(events_dir.glob("*.running"))
    assert "replica group 1 resumes from /ckpt/step4.ckpt (step 4; 2 checkpoint(s)" in proc.stderr, \
        proc.stderr
    assert {r["FSDP_STRATEGIES_FT_EVENTS"] for r in _tool(calls, "torchrun")} == {
        f"{events_dir}/group{{replica_group_id}}.jsonl"}
    (lighthouse,) = _tool(calls, "torchft_lighthouse")
    assert lighthouse["argv"] == lighthouse_args(min_replicas=1, port=port, heartbeat_timeout_ms=HEARTBEAT_MS)
    assert lighthouse["SLURMD_NODENAME"] == nodes[0]
    assert not Path(f"/proc/{lighthouse['pid']}").exists(), "the lighthouse step outlived the job"
    lighthouse_srun = next(c for c in _tool(calls, "srun") if c["cmd"][0] == "torchft_lighthouse")
    assert lighthouse_srun["opts"].get("--overlap") is True and lighthouse_srun["nodes"] == nodes[:1]

    runs = _tool(calls, "torchrun")
    for group in (0, 1):
        mine = [r for r in runs if r["REPLICA_GROUP_ID"] == str(group)]
        # group 1 lost an agent in its first attempt and was started again (on both of its nodes)
        assert sorted(r["SLURMD_NODENAME"] for r in mine) == sorted(
            nodes[2 * group : 2 * group + 2] * (1 + group)
        )
        # each group's rendezvous on its first node, port RDZV_PORT + group (2 "nodes" may be one host)
        expected = ft_agent_args(
            rdzv_endpoint=f"{nodes[2 * group]}:{29500 + group}", rdzv_id=f"4242-group{group}"
        )
        for run in mine:
            assert run["argv"] == expected, (run["argv"], expected)
            assert (run["NUM_REPLICA_GROUPS"], run["TORCHFT_LIGHTHOUSE"]) == ("2", f"http://{nodes[0]}:{port}")
    assert "replica group 1 failed; restart 1 of 1" in proc.stderr

    # no restart left: the group is given up, the job fails, the other group still finished
    proc, calls = _render(tmp_path / "no_restart", "ft_hsdp.sbatch", FT_EXTRA,
                          {**env, "MAX_RESTARTS": "0", "LIGHTHOUSE_PORT": str(free_port())})
    assert proc.returncode == 1 and "replica group 1 failed 1 times; giving it up" in proc.stderr, proc.stderr
    assert sum(r["REPLICA_GROUP_ID"] == "0" for r in _tool(calls, "torchrun")) == 2

    # nodes that do not split into groups: a clear error before any step starts
    proc, calls = _render(tmp_path / "odd", "ft_hsdp.sbatch", [], {**env, "NODES_PER_GROUP": "3"})
    assert proc.returncode == 2 and "NODES_PER_GROUP=3" in proc.stderr and "Fix:" in proc.stderr
    assert not _tool(calls, "srun")


# ---------------------------------------------------------------------------- Trainer split vs torchrun's
# nodes
def test_a_trainer_split_other_than_torchruns_nodes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two agents x 2 ranks, but Trainer(num_nodes=1, devices=4): Lightning accepts it (the product is
    # the world size), and hsdp 'auto' / hierarchical_sgd's node level would span both nodes silently.
    # Measured before the check: hsdp built replicate 1 x shard 4 and hierarchical_sgd levels {4: 4}.
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.demos.boring_classes import BoringModel

    from fsdp_strategies import DDPHooksStrategy, HSDPStrategy

    as_torchrun_rank0(monkeypatch, world_size=4, local_world_size=2)
    refused = r"num_nodes=1 x devices=4 does not match torchrun's 2 node\(s\) x 2 rank\(s\) per node.*" \
              r"Fix: set trainer.num_nodes=2 and trainer.devices=2"
    with pytest.raises(ValueError, match=refused):
        pl.Trainer(strategy=HSDPStrategy(), accelerator="cpu", devices=4, num_nodes=1, logger=False)
    # torchrun's split
    pl.Trainer(strategy=HSDPStrategy(), accelerator="cpu", devices=2, num_nodes=2, logger=False)
    trainer = pl.Trainer(strategy=DDPHooksStrategy(comm_hook="hierarchical_sgd"), accelerator="cpu",
                         devices=4, num_nodes=1, logger=False, max_steps=1, enable_progress_bar=False)
    with pytest.raises(ValueError, match=refused):
        trainer.fit(BoringModel())
    assert not dist.is_initialized()  # refused before any process group
