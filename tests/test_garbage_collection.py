"""GarbageCollection: options, the schedule, the automatic collector restored on every way out of ``fit``, the
pauses the StragglerDetector leaves out of a rank's self time, and 2 ranks collecting at the same steps."""

from __future__ import annotations

import csv
import gc
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

from conftest import ROOT, WORKERS, run_python
from fsdp_strategies.callbacks import GarbageCollection, StragglerDetector, straggler_timing
from fsdp_strategies.callbacks import garbage_collection as gc_module
from fsdp_strategies.callbacks.straggler_gather import WindowGather
from fsdp_strategies.protocols import HostPauseSource
from llama import LlamaLM, MarkovDataModule

TINY = {"vocab_size": 32, "dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16, "warmup_steps": 1}


@pytest.fixture(autouse=True)
def automatic_gc_restored() -> Iterator[None]:
    """Whatever a test does, the session goes on with the collector as it found it."""
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()


# ---------------------------------------------------------------------- options and schedule
@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"every_n_steps": 0}, "every_n_steps=0"),
    ({"generation": 3}, "generation=3"),
    ({"generation": -1}, "generation=-1"),
    ({"every_n_steps": 50, "full_every_n_steps": 75}, "full_every_n_steps=75"),
    ({"full_every_n_steps": 0}, "full_every_n_steps=0"),
    ({"disable_automatic": "yes"}, "disable_automatic='yes'"),
])
def test_bad_options_fail_early(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match="Fix: ") as info:
        GarbageCollection(**kwargs)
    assert needle in str(info.value)


def test_full_every_n_steps_must_be_a_multiple_and_the_fix_says_which() -> None:
    with pytest.raises(ValueError, match=r"multiple of every_n_steps=50.*Fix: e.g. 50 or 100, or null"):
        GarbageCollection(every_n_steps=50, full_every_n_steps=75)
    with pytest.raises(ValueError, match=r"Fix: e.g. 50,? or null"):
        GarbageCollection(every_n_steps=50, full_every_n_steps=20)


def test_schedule() -> None:
    cb = GarbageCollection(every_n_steps=3, generation=0, full_every_n_steps=9)
    assert [cb.generation_at(s) for s in range(10)] == [None, None, None, 0, None, None, 0, None, None, 2]
    assert GarbageCollection(every_n_steps=2, full_every_n_steps=None).generation_at(1000) == 1
    assert isinstance(cb, HostPauseSource) and not isinstance(StragglerDetector(), HostPauseSource)


# ---------------------------------------------------------------------- single-process fits
class GCStateProbe(pl.Callback):
    """Whether automatic collection was on at each training / validation batch."""

    def __init__(self) -> None:
        self.train: list[bool] = []
        self.val: list[bool] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.train.append(gc.isenabled())

    def on_validation_batch_start(self, *args: Any) -> None:
        self.val.append(gc.isenabled())


class FailingLM(LlamaLM):
    """Raises ``error`` in the training step of batch ``at``."""

    def __init__(self, error: BaseException, at: int = 3) -> None:
        super().__init__(**TINY)
        self.error, self.at = error, at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.at:
            raise self.error
        return super().training_step(batch, batch_idx)


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    options = {"accelerator": "cpu", "devices": 1, "max_steps": 8, "logger": False,
               "enable_checkpointing": False,
               "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
               "default_root_dir": str(tmp_path), **kwargs}
    return pl.Trainer(callbacks=callbacks, **options)


def _data() -> MarkovDataModule:
    return MarkovDataModule(
        vocab_size=TINY["vocab_size"], seq_len=TINY["max_seq_len"], num_train=256, num_val=8, batch_size=4
    )


def test_collects_at_the_scheduled_steps_logs_them_and_restores_automatic_gc(tmp_path: Path) -> None:
    gc.enable()
    cb, probe = GarbageCollection(every_n_steps=2, generation=0, full_every_n_steps=4), GCStateProbe()
    # gradient accumulation (2 batches per optimizer step) and a validation in between
    trainer = _trainer(tmp_path, [cb, probe], max_steps=7, accumulate_grad_batches=2, limit_val_batches=1,
                       val_check_interval=6, num_sanity_val_steps=0, logger=CSVLogger(tmp_path, name="csv"),
                       log_every_n_steps=3)
    trainer.fit(LlamaLM(**TINY), _data())
    assert gc.isenabled()
    assert probe.train and not any(probe.train) and probe.val and not any(probe.val)
    # one full collection at the start, then generation 0 at even steps, full at multiples of 4; once per step
    assert [(c.step, c.generation) for c in cb.collections] == [(0, 2), (2, 0), (4, 2), (6, 0)]
    assert all(c.seconds > 0 and c.collected >= 0 for c in cb.collections)
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    logged = {int(r["step"]): r for r in rows if r.get("gc/seconds")}
    assert sorted(logged) == [0, 2, 4, 6]  # every collection, whatever log_every_n_steps
    assert float(logged[4]["gc/generation"]) == 2 and float(logged[6]["gc/seconds_total"]) == pytest.approx(
        sum(c.seconds for c in cb.collections))
    # validate and test after fit leave it on, and do not collect
    trainer.validate(trainer.lightning_module, _data(), verbose=False)
    assert gc.isenabled()
    assert len(cb.collections) == 4


def test_validate_and_test_alone_leave_automatic_gc_alone(tmp_path: Path) -> None:
    gc.enable()

    class TestLM(LlamaLM):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", self._loss(batch))

    data = _data()
    data.test_dataloader = data.val_dataloader  # type: ignore[method-assign]
    probe, cb = GCStateProbe(), GarbageCollection(every_n_steps=1)
    trainer = _trainer(tmp_path, [cb, probe], limit_val_batches=2, limit_test_batches=2)
    trainer.validate(TestLM(**TINY), data, verbose=False)
    assert gc.isenabled() and probe.val == [True, True]
    trainer.test(TestLM(**TINY), data, verbose=False)
    assert gc.isenabled() and cb.collections == []


def test_restored_after_an_exception_in_training_step(tmp_path: Path) -> None:
    gc.enable()
    cb = GarbageCollection(every_n_steps=1)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, [cb]).fit(FailingLM(RuntimeError("boom")), _data())
    assert gc.isenabled()
    assert [c.step for c in cb.collections] == [0, 1, 2, 3]  # collected until the failure


def test_restored_after_a_keyboard_interrupt(tmp_path: Path) -> None:
    gc.enable()
    handler = signal.getsignal(signal.SIGINT)
    try:  # Lightning's graceful shutdown ignores further SIGINTs and exits with status 1
        with pytest.raises(SystemExit):
            _trainer(tmp_path, [GarbageCollection(every_n_steps=1)]).fit(
                FailingLM(KeyboardInterrupt()), _data()
            )
    finally:
        signal.signal(signal.SIGINT, handler)
    assert gc.isenabled()


def test_a_user_who_disabled_automatic_gc_keeps_it_disabled(tmp_path: Path) -> None:
    gc.disable()
    cb = GarbageCollection(every_n_steps=4, full_every_n_steps=None)
    _trainer(tmp_path, [cb]).fit(LlamaLM(**TINY), _data())
    assert not gc.isenabled()
    assert [(c.step, c.generation) for c in cb.collections] == [(0, 2), (4, 1), (8, 1)]
    with pytest.raises(RuntimeError, match="boom"):  # and after an exception too
        _trainer(tmp_path, [GarbageCollection(every_n_steps=4)]).fit(FailingLM(RuntimeError("boom")), _data())
    assert not gc.isenabled()


def test_disable_automatic_false_keeps_it_on_and_still_collects(tmp_path: Path) -> None:
    gc.enable()
    cb, probe = GarbageCollection(every_n_steps=4, disable_automatic=False), GCStateProbe()
    _trainer(tmp_path, [cb, probe]).fit(LlamaLM(**TINY), _data())
    assert all(probe.train) and gc.isenabled()
    assert [c.step for c in cb.collections] == [0, 4, 8]


# ---------------------------------------------------------------------- what StragglerDetector counts
class FakeClock:
    """Each simulated rank's own clock (wall = CPU time: every simulated second is busy)."""

    def __init__(self) -> None:
        self.now = {0: 100.0, 1: 100.0}
        self.rank = 0

    def advance(self, seconds: float) -> None:
        self.now[self.rank] += seconds

    def perf_counter(self) -> float:
        return self.now[self.rank]

    process_time = thread_time = perf_counter


class ExchangeGather(WindowGather):
    """The window all_gather replaced by an in-process exchange between simulated ranks."""

    def __init__(self, rank: int, exchange: dict[int, dict[int, np.ndarray]]) -> None:
        super().__init__()
        self.rank, self.exchange = rank, exchange

    def _all_gather(self, local: np.ndarray, step: int) -> Any:
        rows = self.exchange.setdefault(step, {})
        rows[self.rank] = local
        return lambda: np.stack([rows[0], rows[1]])


class ExchangingDetector(StragglerDetector):
    """The detector with its window gather exchanging between simulated ranks."""

    def __init__(self, rank: int, exchange: dict[int, dict[int, np.ndarray]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank, self.exchange = rank, exchange

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.gather = ExchangeGather(self.rank, self.exchange)


class UnreportedPause(pl.Callback):
    """The same pause as a slow collection, from something that does not report it."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def on_train_batch_end(self, *args: Any) -> None:
        self.clock.advance(self.seconds)


PAUSE_S, STEPS = 0.05, 14


def _simulate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pause: str, order: str
) -> list[ExchangingDetector]:
    """Two ranks' hooks driven step by step on fake clocks; rank 1 pauses ``PAUSE_S`` after every optimizer
    step, in a collection it reports (``pause="gc"``) or in a callback that does not (``pause="other"``)."""
    clock, exchange = FakeClock(), {}
    monkeypatch.setattr(straggler_timing, "time", clock)
    monkeypatch.setattr(gc_module, "time", clock)
    real_collect = gc.collect

    def slow_collect(generation: int = 2) -> int:  # a collection that takes PAUSE_S on rank 1
        if clock.rank == 1:
            clock.advance(PAUSE_S)
        return real_collect(generation)

    monkeypatch.setattr(gc, "collect", slow_collect)
    ranks = []
    for rank in (0, 1):
        detector = ExchangingDetector(rank, exchange, window=4, skip_first=2, patience=2)
        extra: pl.Callback = (
            GarbageCollection(every_n_steps=1)
            if pause == "gc" or rank == 0
            else UnreportedPause(clock, PAUSE_S if rank == 1 else 0.0)
        )
        callbacks = [detector, extra] if order == "detector_first" else [extra, detector]
        trainer = SimpleNamespace(
            callbacks=callbacks,
            world_size=2,
            global_rank=rank,
            is_global_zero=rank == 0,
            strategy=SimpleNamespace(root_device=SimpleNamespace(type="cpu")),
            loggers=[],
            log_dir=str(tmp_path / f"{pause}{order}"),
            global_step=0,
            fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False)),
        )
        detector.setup(trainer, None, "fit")  # type: ignore[arg-type]
        detector.hosts = ["host0", "host1"]
        ranks.append((trainer, callbacks))
    for rank, (trainer, callbacks) in enumerate(ranks):
        clock.rank = rank
        for cb in callbacks:
            cb.on_train_start(trainer, None)
    for _ in range(STEPS):
        # one step of each rank in turn, each on its own clock
        for rank, (trainer, callbacks) in enumerate(ranks):
            clock.rank = rank
            detector = next(c for c in callbacks if isinstance(c, StragglerDetector))
            clock.advance(0.002)  # loading the batch
            detector.on_train_batch_start(trainer, None, None, 0)
            clock.advance(0.010)  # forward and backward
            detector.on_before_optimizer_step(trainer, None, None)
            clock.advance(0.003)  # the optimizer step
            trainer.global_step += 1
            for cb in callbacks:
                cb.on_train_batch_end(trainer, None, None, None, 0)
    for rank, (trainer, callbacks) in enumerate(ranks):
        clock.rank = rank
        for cb in callbacks:
            cb.on_train_end(trainer, None)
    return [next(c for c in callbacks if isinstance(c, StragglerDetector)) for _, callbacks in ranks]


@pytest.mark.parametrize("order", ["detector_first", "gc_first"])
def test_a_reported_collection_pause_is_not_a_straggler_and_the_same_pause_unreported_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    reported = _simulate(tmp_path, monkeypatch, "gc", order)
    unreported = _simulate(tmp_path, monkeypatch, "other", order)
    for detectors in (reported, unreported):  # both ranks scored the same gathered windows
        assert detectors[0].report()["windows"] == detectors[1].report()["windows"]
    rep, other = reported[0].report(), unreported[0].report()
    # windows end after batches 4, 8 and 12; the first 2 batches are skipped and 12-13 start a 4th, unfinished
    # one
    assert len(rep["windows"]) == len(other["windows"]) == 3
    measured = 10
    # reported: subtracted from rank 1's self time (equal to rank 0's), reported as pause, never slow
    assert rep["persistent"] == [] and rep["slow_windows"] == [0, 0] and rep["stalls"] == [0, 0]
    assert rep["pause_s"] == pytest.approx([0.0, measured * PAUSE_S])
    for window in rep["windows"]:
        assert window["mean_self"][1] == pytest.approx(window["mean_self"][0])
        assert window["pause"] == pytest.approx([0.0, PAUSE_S])
        assert window["mean_step"][1] == pytest.approx(window["mean_step"][0] + PAUSE_S)
    assert rep["lost_s"] == 0.0
    # unreported: the same pause is rank 1's own time, which makes it a persistent straggler
    assert other["persistent"] == [1] and other["slow_windows"][1] == 3 and other["pause_s"] == [0.0, 0.0]
    assert other["windows"][-1]["mean_self"][1] == pytest.approx(
        other["windows"][-1]["mean_self"][0] + PAUSE_S
    )
    assert other["lost_s"] == pytest.approx(measured * PAUSE_S)


# ---------------------------------------------------------------------- 2 ranks
@pytest.mark.multiprocess
def test_two_ranks_collect_at_the_same_steps_under_fsdp2_from_the_config(tmp_path: Path) -> None:
    # configs/gc.yaml with a short schedule: callbacks are a list, so the overrides go into a copy of the file
    config = yaml.safe_load((ROOT / "configs" / "gc.yaml").read_text())
    detector, collector = config["trainer"]["callbacks"]
    assert detector["class_path"] == "fsdp_strategies.callbacks.StragglerDetector"
    assert collector["class_path"] == "fsdp_strategies.callbacks.GarbageCollection"
    collector["init_args"].update(every_n_steps=2, full_every_n_steps=4)
    detector["init_args"].update(window=3, skip_first=1)
    (tmp_path / "gc.yaml").write_text(yaml.safe_dump(config))
    run_python([str(WORKERS / "gc_train.py"), "--out", str(tmp_path), "--config", str(tmp_path / "gc.yaml"),
                "--trainer.max_steps", "9", "--trainer.val_check_interval", "5",
                "--trainer.limit_val_batches", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
                "--trainer.logger.init_args.save_dir", str(tmp_path), "--model.dim", "32", "--model.n_layers",
                "2", "--model.n_heads", "2", "--model.vocab_size", "64", "--model.max_seq_len", "16",
                "--data.vocab_size", "64", "--data.seq_len", "16", "--data.num_train", "512",
                "--data.num_val", "8"],
               timeout=400)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and {r["strategy"] for r in ranks} == {"FSDP2Strategy"}
    steps = [[(c[0], c[1]) for c in r["collections"]] for r in ranks]
    assert steps[0] == steps[1] == [(0, 2), (2, 1), (4, 2), (6, 1), (8, 2)]
    for r in ranks:
        assert (
            r["global_step"] == 9
            and r["enabled_before"]
            and r["enabled_after_fit"]
            and r["enabled_after_validate"]
        )
        assert r["enabled_in_train"] and not any(r["enabled_in_train"])
        # the sanity check before training starts (on), fit's validation at step 5 (off), validate() after fit
        # (on)
        assert r["enabled_in_val"] == [True, False, True]
        # the detector on every rank gathered each rank's collection time as a pause, never more than it
        # measured
        assert r["pause_s"] == ranks[0]["pause_s"] and r["windows"] >= 2
    for rank, r in enumerate(ranks):
        own = sum(c[2] for c in r["collections"])
        assert 0 < ranks[0]["pause_s"][rank] <= own
