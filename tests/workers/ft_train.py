"""Worker for the ft_hsdp tests: the example's LightningCLI plus a probe callback.

Started per replica group by ``fsdp-strategies-ft`` (torchrun) -- or directly for the hsdp
reference run. The probe (configured through environment variables) records, per rank and
per step, a digest of this rank's parameter and optimizer-state shards before and after the
step together with the commit decision, can SIGKILL its whole group in the middle of the
cross-group all-reduce, and dumps the final shards, full parameters and step counters.

    FT_TEST_OUT        folder for records and dumps (required)
    FT_TEST_KILL       "GROUP:STEP:CALL": in its first incarnation, group GROUP kills itself (torchrun and
                       every rank) just before its CALL-th cross-group all-reduce of committed step STEP
                       (sync="local_sgd"/"diloco": of the outer sync that ends at inner step STEP)
    FT_TEST_SLEEP      seconds to sleep after each step (paces training so restarts overlap it)
    FT_TEST_LEAVE      "GROUP:INCARNATION:STEP": that incarnation of the group calls ``leave_quorum``
                       after STEP
    FT_TEST_STRAGGLER  "GROUP:RANK:DELAY": the first incarnation of GROUP runs
                       StragglerDetector(action="evict") with rank RANK stalled DELAY s per step (the whole
                       group must leave the quorum together)
    FT_TEST_CKPT       folder: add a ModelCheckpoint saving every FT_TEST_CKPT_EVERY steps (``step<N>.ckpt``)
    FT_TEST_BREAK_WRITE  "GROUP:N": the first incarnation of GROUP dies right after its N-th DCP shard write
    FT_TEST_SLEEP_ALONE  seconds to sleep after a step committed by fewer groups than NUM_REPLICA_GROUPS
    FT_TEST_AWAIT_SPARES  "STEP:N": after committed step STEP, the first incarnation waits until N warm
                       spares are ready (``*.ready`` files beside the events file): a kill after STEP then
                       hits a ready spare
    (semi-sync: every outer sync also writes ``syncs/group<G>_rank<R>_inc<I>_m<MANAGER STEP>.pt``: this rank's
    DiLoCo backup, local parameters and outer momentum before the sync, parameters and momentum after it, and
    whether it committed, with how many groups and whether this group healed -- the inputs and outputs of one
    outer step, for tests that recompute it by hand)
    FT_TEST_HANG       "GROUP:RANK:STEP:TIMEOUT": every group runs ``HangWatchdog(timeout_s=TIMEOUT,
                       poll_s=1)``; in its first incarnation, rank RANK of group GROUP sleeps forever when it
                       starts step STEP
    FT_TEST_NAN        "GROUP:RANK:STEP": every group runs ``NonFiniteGuard``; rank RANK of group GROUP
                       makes its loss NaN at committed step STEP (a forward hook multiplies the module's
                       output by NaN)
    FT_TEST_ALL_DIE_AT  "STEP": the first incarnation of every group kills itself (torchrun and every rank)
                       right after committed step STEP -- no live peer is left to heal from
    FT_TEST_AWAIT_REJOIN  "GROUP": the other groups, after each step they commit alone, wait until a restarted
                       incarnation of GROUP has started training (a survivor must not finish before it joins)
    FT_TEST_GRAD_BYTES "1": each record also holds the gradient bytes FSDP2 held right after the micro-batch's
                       backward (``fsdp_strategies.testing.fsdp_gradient_bytes``) and the full model's
    FT_TEST_REJOIN_AFTER  "N": a restarted incarnation of the FT_TEST_KILL group waits until the other group
                       has committed N steps alone before it starts (makes "survivors keep training while a
                       group is down" independent of how fast a restart is on the machine)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# whether this process started with Lightning already imported (``--runner forkserver`` forks it from a server
# that preloaded it; torchrun starts a fresh interpreter)
PREIMPORTED = "lightning.pytorch" in sys.modules

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from group_kill import kill_own_group  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import fsdp_strategies  # noqa: F401, E402
from fsdp_strategies.ft import FTHSDPStrategy  # noqa: E402
from fsdp_strategies.testing import HangInjector, fsdp_gradient_bytes, state_digest  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402


def _outer(strategy: Any) -> Any:
    """The strategy's OuterSync (sync local_sgd/diloco, or straggler_sync after train start), else None."""
    semi = getattr(strategy, "_semi", None)
    return None if semi is None else semi.outer


def _outer_state(strategy: Any) -> dict[str, torch.Tensor]:
    """Semi-sync: this rank's DiLoCo backup parameters and outer-optimizer state (what a heal must carry)."""
    out: dict[str, torch.Tensor] = {}
    outer = _outer(strategy)
    if outer is None:
        return out
    for i, fragment in enumerate(outer._diloco._fragments):
        for name, value in fragment.original_parameters.items():
            out[f"backup{i}.{name}"] = value
        for idx, state in fragment._outer_optimizer.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"outer{i}.{idx}.{key}"] = value
    return out


def _shards(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in pl_module.state_dict().items()}
    for i, opt in enumerate(trainer.optimizers):
        for idx, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{i}.{idx}.{key}"] = value
    return out


class FTProbe(pl.Callback):
    def __init__(self) -> None:
        self.out = Path(os.environ["FT_TEST_OUT"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.kill = os.environ.get("FT_TEST_KILL")
        self.sleep = float(os.environ.get("FT_TEST_SLEEP", "0"))
        self.sleep_alone = float(os.environ.get("FT_TEST_SLEEP_ALONE", "0"))
        self.groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
        self.incarnation = int(os.environ.get("FT_RESTART_COUNT", "0"))
        self.group = os.environ.get("REPLICA_GROUP_ID", "hsdp")
        self._before = ""
        self._step_before = 0
        self._held: dict[str, int] | None = None

    def _tag(self, trainer: pl.Trainer) -> str:
        return f"group{self.group}_rank{trainer.global_rank}"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._break_write(trainer)
        strategy = trainer.strategy
        if isinstance(strategy, FTHSDPStrategy):  # count the cross-group all-reduces (any mode, any path)
            pg, counted = strategy.cross_group_pg, strategy.cross_group_pg.allreduce
            self.allreduces = 0

            def counting_allreduce(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
                self.allreduces += 1
                return counted(tensors, *args, **kwargs)

            pg.allreduce = counting_allreduce
        if not (self.kill and isinstance(strategy, FTHSDPStrategy) and self.incarnation == 0):
            return
        if strategy.sync != "every_step":
            group, step, call = (int(x) for x in self.kill.split(":"))
            if group != strategy.replica_group_id:
                return
            inner, sync_calls = strategy.manager.allreduce, {"n": 0}

            def killing_sync_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if _outer(strategy) is not None and strategy._committed_step() == step:
                    sync_calls["n"] += 1
                    if sync_calls["n"] == call:
                        print(f"FT_TEST: group {group} kills itself in "
                              f"all-reduce #{call} of the sync at {step}",
                              flush=True)
                        kill_own_group()
                        time.sleep(60)
                return inner(tensor, *args, **kwargs)

            strategy.manager.allreduce = killing_sync_allreduce
            return
        group, step, call = (int(x) for x in self.kill.split(":"))
        if group != strategy.replica_group_id:
            return
        # every cross-group gradient all-reduce goes through CrossGroupReduce._all_reduce (one per FSDP unit,
        # or one per dtype after the last micro-batch under accumulation)
        original = strategy._step.cross._all_reduce
        calls = {"n": 0}

        def killing_all_reduce(reduce_output: torch.Tensor, op: Any, wait: bool = True) -> None:
            if strategy.manager.current_step() == step:
                calls["n"] += 1
                if calls["n"] == call:
                    print(
                        f"FT_TEST: group {group} kills itself in all-reduce #{call} of step {step}",
                        flush=True,
                    )
                    kill_own_group()  # torchrun agent + every rank of this group
                    time.sleep(60)
            original(reduce_output, op, wait)

        strategy._step.cross._all_reduce = killing_all_reduce  # type: ignore[method-assign]

    def _break_write(self, trainer: pl.Trainer) -> None:
        """FT_TEST_BREAK_WRITE="GROUP:N": the first incarnation of GROUP dies (torchrun + every rank) right
        after its N-th DCP write_data -- the shards are on disk, the checkpoint is not committed."""
        spec = os.environ.get("FT_TEST_BREAK_WRITE")
        if not spec or self.incarnation != 0 or spec.split(":")[0] != self.group:
            return
        from torch.distributed.checkpoint import FileSystemWriter

        nth, real, calls = int(spec.split(":")[1]), FileSystemWriter.write_data, {"n": 0}

        def write_data(writer, plan, planner):  # type: ignore[no-untyped-def]
            result = real(writer, plan, planner)
            calls["n"] += 1
            if calls["n"] == nth:
                result.wait()
                print(f"FT_TEST: group {self.group} rank "
                      f"{trainer.global_rank} dies in the middle of checkpoint "
                      f"write #{nth} ({writer.path})", flush=True)
                kill_own_group()
                time.sleep(60)
            return result

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]

    def _dump_syncs(self, trainer: pl.Trainer) -> None:
        """Wrap the strategy's OuterSync.sync (once) to save each outer step's inputs and outputs (see
        above)."""
        outer = _outer(trainer.strategy)
        if outer is None or getattr(outer, "_probe_dumps", False):
            return
        outer._probe_dumps = True
        real, manager, folder = outer.sync, trainer.strategy.manager, self.out / "syncs"
        folder.mkdir(exist_ok=True)

        def local(value: torch.Tensor) -> torch.Tensor:
            return (value.to_local() if hasattr(value, "to_local") else value).detach().clone()

        def momentum(fragment: Any) -> dict[str, torch.Tensor | None]:
            state = fragment._outer_optimizer.state
            return {n: (state.get(p, {}).get("momentum_buffer") if p in state else None)
                    for n, p in fragment._model_fragment.named_parameters()}

        def dumping_sync(*args: Any, **kwargs: Any) -> bool:
            fragments = outer._diloco._fragments
            if len(fragments) != 1:
                return real(*args, **kwargs)
            fragment, step = fragments[0], int(manager.current_step())
            before = {"backup": {n: v.detach().clone() for n, v in fragment.original_parameters.items()},
                      "local": {n: local(p) for n, p in fragment._model_fragment.named_parameters()},
                      "momentum": {n: None if b is None else local(b) for n, b in momentum(fragment).items()}}
            committed = real(*args, **kwargs)
            after = {"params": {n: local(p) for n, p in fragment._model_fragment.named_parameters()},
                     "momentum": {n: None if b is None else local(b) for n, b in momentum(fragment).items()}}
            path = folder / f"group{self.group}_rank{trainer.global_rank}_inc{self.incarnation}_m{step}.pt"
            torch.save({"before": before, "after": after, "committed": bool(committed),
                        "healed": bool(outer.healed),
                        "participants": int(outer.last_participants), "manager_step": step},
                       path.with_suffix(".tmp"))
            # a SIGKILL of the group mid-write leaves no torn record
            os.replace(path.with_suffix(".tmp"), path)
            return committed

        outer.sync = dumping_sync

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._dump_syncs(trainer)
        self._before = state_digest(_shards(trainer, pl_module))
        self._step_before = trainer.global_step
        self._allreduces_before = getattr(self, "allreduces", 0)
        switchable = getattr(trainer.strategy, "sync_switch_available", False)
        self._semi_before = bool(trainer.strategy._semi.active) if switchable else None
        if _outer(trainer.strategy) is not None:  # semi-sync: the state the step starts from
            self._model_before = state_digest(dict(pl_module.state_dict()))
            self._outer_before = state_digest(_outer_state(trainer.strategy))
        self._batch = int(batch.sum()) if isinstance(batch, torch.Tensor) else None
        self._epoch = trainer.current_epoch

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if os.environ.get("FT_TEST_GRAD_BYTES"):
            self._held = fsdp_gradient_bytes(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        if self._held is not None:
            full = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
            self._held = {**self._held, "full": full}
        record = {"held": self._held,
            "incarnation": self.incarnation, "step_before": self._step_before,
            "step_after": trainer.global_step,
            "before": self._before, "after": state_digest(_shards(trainer, pl_module)),
            "loss": float(outputs["loss"]) if isinstance(outputs, dict) else None,
            "batch_sum": self._batch, "epoch": self._epoch, "batch_idx": batch_idx,
            "lr": trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None,
        }
        if isinstance(strategy, FTHSDPStrategy):
            record.update(committed=strategy.last_step_committed,
                          manager_step=int(strategy.manager.current_step()),
                          participants=int(strategy.manager.num_participants()),
                          allreduces=self.allreduces - self._allreduces_before)
            if _outer(strategy) is not None:  # sync local_sgd/diloco, or straggler_sync
                model = {k: v for k, v in pl_module.state_dict().items()}
                record.update(syncs=int(strategy.ft_stats["syncs"]), model=state_digest(model),
                              model_before=self._model_before, outer_before=self._outer_before,
                              outer=state_digest(_outer_state(strategy)),
                              healed=bool(_outer(strategy).healed),
                              sync_participants=_outer(strategy).last_participants,
                              semi_before=self._semi_before, semi=bool(strategy._semi.active),
                              switches=int(strategy.ft_stats.get("switches", 0)))
        with (self.out / f"{self._tag(trainer)}.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        leave = os.environ.get("FT_TEST_LEAVE")
        if leave and isinstance(strategy, FTHSDPStrategy):
            group, incarnation, step = (int(x) for x in leave.split(":"))
            if (group, incarnation) == (
                strategy.replica_group_id,
                self.incarnation,
            ) and trainer.global_step >= step:
                strategy.leave_quorum(f"test eviction at step {trainer.global_step}")
        die_at = os.environ.get("FT_TEST_ALL_DIE_AT")
        if die_at and self.incarnation == 0 and trainer.global_step == int(die_at):
            print(f"FT_TEST: group {self.group} kills itself after step {die_at} (every group does)",
                  flush=True)
            kill_own_group()
            time.sleep(60)
        self._await_spares(trainer)
        if self.sleep:
            time.sleep(self.sleep)
        if record.get("participants", self.groups) < self.groups:
            self._await_rejoin()
            time.sleep(self.sleep_alone)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.incarnation > 0 and os.environ.get("FT_TEST_AWAIT_REJOIN") == self.group:
            (self.out / f"group{self.group}_inc{self.incarnation}.started").touch()

    def _await_rejoin(self) -> None:
        group = os.environ.get("FT_TEST_AWAIT_REJOIN")
        if group is None or group == self.group:
            return
        deadline = time.monotonic() + 180
        while not list(self.out.glob(f"group{group}_inc*.started")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group} was never restarted ({self.out})")
            time.sleep(0.1)

    def _await_spares(self, trainer: pl.Trainer) -> None:
        spec = os.environ.get("FT_TEST_AWAIT_SPARES")
        if not spec or self.incarnation != 0:
            return
        step, count = (int(x) for x in spec.split(":"))
        if trainer.global_step != step:
            return
        from fsdp_strategies.ft.protocol import FTEnvironment

        events = Path(FTEnvironment.from_env().events_file or "").parent
        deadline = time.monotonic() + 240
        while len(list(events.glob("*.spare*.go.ready"))) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} warm spares never became ready in {events}")
            time.sleep(0.1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        shards = {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                  for k, v in {**_shards(trainer, pl_module), **_outer_state(trainer.strategy)}.items()}
        full = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pl_module.state_dict().items()
        }
        strategy = trainer.strategy
        dump = {"shards": shards, "full": full, "global_step": trainer.global_step,
                "incarnation": self.incarnation, "preimported": PREIMPORTED, "pid": os.getpid(),
                "ppid": os.getppid(),
                "manager_step": int(strategy.manager.current_step()) if isinstance(strategy,
                                                                                   FTHSDPStrategy) else None,
                "ft_stats": dict(strategy.ft_stats) if isinstance(strategy, FTHSDPStrategy) else None,
                "ft_metrics": {k: float(v) for k,
                               v in trainer.callback_metrics.items() if k.startswith("ft/")},
                "val_loss": float(trainer.callback_metrics["val_loss"])
                    if "val_loss" in trainer.callback_metrics
                else None}
        torch.save(dump, self.out / f"{self._tag(trainer)}.pt")


def _wait_for_survivor() -> None:
    need = int(os.environ.get("FT_TEST_REJOIN_AFTER", "0"))
    kill = os.environ.get("FT_TEST_KILL")
    if not need or not kill or int(os.environ.get("FT_RESTART_COUNT", "0")) == 0:
        return
    group, groups = int(kill.split(":")[0]), int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    if str(group) != os.environ.get("REPLICA_GROUP_ID"):
        return
    other = Path(os.environ["FT_TEST_OUT"]) / f"group{(group + 1) % groups}_rank0.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if other.exists():
            records = [json.loads(line) for line in other.read_text().splitlines() if line.strip()]
            if sum(1 for r in records if r["committed"] and r["participants"] < groups) >= need:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the surviving group never committed {need} steps alone ({other})")


class NaNOutputAt(pl.Callback):
    """At step ``step`` this rank's module output (hence its loss and gradients) is NaN."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.handle: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.handle = pl_module.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def main() -> None:
    _wait_for_survivor()
    callbacks: list[pl.Callback] = [FTProbe()]
    nan = os.environ.get("FT_TEST_NAN")
    if nan:
        from fsdp_strategies.callbacks import NonFiniteGuard

        group, rank, step = nan.split(":")
        callbacks.append(NonFiniteGuard(max_consecutive=2))
        if group == os.environ.get("REPLICA_GROUP_ID"):
            callbacks.append(NaNOutputAt(int(rank), int(step)))
    if os.environ.get("FT_TEST_CKPT"):
        callbacks.append(ModelCheckpoint(dirpath=os.environ["FT_TEST_CKPT"], filename="step{step}",
                                         save_top_k=-1,
                                         every_n_train_steps=int(os.environ.get("FT_TEST_CKPT_EVERY", "4")),
                                         save_on_train_epoch_end=False, auto_insert_metric_name=False))
    hang = os.environ.get("FT_TEST_HANG")
    if hang:
        from fsdp_strategies.callbacks import HangWatchdog

        group, rank, step, timeout = hang.split(":")
        callbacks.insert(0, HangWatchdog(timeout_s=float(timeout), poll_s=1.0,
                                         stacks_dir=os.path.join(os.environ["FT_TEST_OUT"], "hang")))
        if group == os.environ.get("REPLICA_GROUP_ID"):  # first incarnation only
            callbacks.insert(1, HangInjector(int(rank), int(step)))
    straggler = os.environ.get("FT_TEST_STRAGGLER")
    if straggler and os.environ.get("FT_RESTART_COUNT", "0") == "0" and \
            straggler.split(":")[0] == os.environ.get("REPLICA_GROUP_ID"):
        from fsdp_strategies.callbacks import StragglerDetector
        from fsdp_strategies.testing import StallInjector, StragglerInjection

        _, rank, delay = straggler.split(":")
        callbacks.append(StallInjector(StragglerInjection(ranks=[int(rank)], delay_s=float(delay))))
        callbacks.append(StragglerDetector(action="evict", window=4, skip_first=1, patience=1,
                                           report_path=os.path.join(os.environ["FT_TEST_OUT"],
                                                                    "straggler.json")))
    LightningCLI(LlamaLM, MarkovDataModule, trainer_defaults={"callbacks": callbacks},
                 save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
