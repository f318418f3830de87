"""Worker: several Lightning fits in a row, in the same real processes (Lightning's launcher, gloo).

    python tests/workers/ddp_train.py --out OUT.pt --devices 2 --runs ddp,allreduce,bf16_compress,...

Each run trains the example Llama (tiny) for ``--steps`` and records, per step: every rank's loss,
whether all ranks hold bit-identical parameters, the hook/averager counters; plus rank 0's final
parameters. ``--runs`` may also hold ``cli:CONFIG`` entries: that YAML goes through LightningCLI, and
``demo:HOOK`` entries: Lightning's own demo Transformer (WikiText2-sized vocabulary, random tokens, no
download) under ``ddp_hooks`` with DDP's default buckets, which split its embedding and decoder apart.
``--bucket-cap-mb`` sets DDP's bucket size of every other run (the reference ``ddp`` included), so
small values give every hook several buckets; ``recap:NAME`` resumes ``resume:NAME``'s checkpoint with
one 25 MB bucket instead; ``accK:NAME`` trains NAME with ``accumulate_grad_batches=K`` (a row per
micro-batch).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.demos.transformer import LightningTransformer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from fsdp_strategies import DDPHooksStrategy  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402

TINY_MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-2,
              "warmup_steps": 2}
TINY_DATA = {"vocab_size": 64, "seq_len": 32, "batch_size": 8, "num_train": 512, "num_val": 32,
             "shuffle": False}


class Recorder(pl.Callback):
    """Per step: loss of every rank, parameter agreement across ranks, schedule counters."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.val_in_sync: list[tuple[int, bool]] = []  # (step, all ranks identical when validation starts)
        self.save_in_sync: list[tuple[int, bool]] = []  # (step, ... while a checkpoint is assembled)

    @staticmethod
    def _params_in_sync(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        flat = torch.cat([p.detach().double().flatten() for p in pl_module.parameters()])
        mine = torch.stack([flat.sum(), (flat * flat).sum()])
        gathered = [torch.empty_like(mine) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, mine)
        return all(bool((g == gathered[0]).all()) for g in gathered)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.state.fn == "fit" and batch_idx == 0:
            self.val_in_sync.append((trainer.global_step, self._params_in_sync(trainer, pl_module)))

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        self.save_in_sync.append((trainer.global_step, self._params_in_sync(trainer, pl_module)))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # what each rank holds after setup / checkpoint restore, before the first step
        strategy = trainer.strategy
        summary: dict[str, Any] = {}
        if isinstance(strategy, DDPHooksStrategy):
            state = strategy.comm_state_dict()
            ps = state.get("powersgd")
            if ps is not None:
                summary = {
                    "iter": ps["iter"],
                    "error": {k: v.double().abs().sum().item() for k, v in ps["error_dict"].items()},
                }
            if "averager" in state:
                summary.update(
                    averager_step=state["averager"]["step"], hook_iter=state["post_local_sgd"]["iter"]
                )
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, summary)
        self.start_states = gathered

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach().double() if isinstance(outputs, dict) else torch.tensor(float("nan"))
        flat = torch.cat([p.detach().double().flatten() for p in pl_module.parameters()])
        mine = torch.stack([loss.reshape(()), flat.sum(), (flat * flat).sum()])
        world = trainer.world_size
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        g = torch.stack(gathered)
        strategy = trainer.strategy
        row: dict[str, Any] = {"step": trainer.global_step, "batch": batch_idx, "loss": g[:, 0].tolist(),
                               "in_sync": bool((g[:, 1:] == g[0, 1:]).all())}
        if world == 4:  # pairs (0,1) and (2,3): the first hierarchy level
            row["pairs_in_sync"] = bool((g[0, 1:] == g[1, 1:]).all() and (g[2, 1:] == g[3, 1:]).all())
        if isinstance(strategy, DDPHooksStrategy):
            state = strategy.comm_state_dict()
            row["averager_step"] = state.get("averager", {}).get("step")
            row["hook_iter"] = (state.get("post_local_sgd") or state.get("powersgd") or {}).get("iter")
            row["local_sgd"] = strategy.local_sgd_enabled
        self.rows.append(row)


class StallProbe(pl.Callback):
    """Rank 1 is held after 4 steps until rank 0 has finished 9 (a file rank 0 writes then), or 120 s.

    With local steps (no collective per step, not even DDP's buffer broadcast) rank 0 runs on and rank 1 sees
    the file; if any step before the next averaging synchronised the ranks, rank 0 could not finish 9 steps
    while rank 1 is held, and rank 1 gives up after 120 s without seeing it. An order of events, not a
    wall-clock threshold.
    """

    def __init__(self, flag: Path) -> None:
        self.flag = flag
        self.saw_rank0_ahead: bool | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 4:  # after 4 steps
            deadline = time.monotonic() + 120
            while not self.flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.saw_rank0_ahead = self.flag.exists()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 9:
            self.flag.write_text("rank 0 finished step 9")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, self.saw_rank0_ahead)
        self.gathered = gathered


def _trainer(strategy: Any, steps: int, devices: int, root: Path, callbacks: list[pl.Callback],
             accumulate: int = 1) -> pl.Trainer:
    # validation after every 5 optimizer steps (val_check_interval counts micro-batches)
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=2, val_check_interval=5 * accumulate, callbacks=callbacks,
                      default_root_dir=str(root), gradient_clip_val=1.0, accumulate_grad_batches=accumulate)


def _strategy(name: str, bucket_cap_mb: float | None = None) -> Any:
    cap: dict[str, Any] = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    if name.endswith("+async"):  # the same strategy with background checkpoint writes
        name, cap = name[: -len("+async")], {**cap, "async_checkpoint": "thread"}
    if name == "ddp":
        return DDPStrategy(**cap) if cap else "ddp"  # Lightning's own, the reference
    if name == "post_local_sgd_period8":
        return DDPHooksStrategy(
            comm_hook="post_local_sgd", local_sgd_period=8, local_sgd_warmup=2, local_group_size=1, **cap
        )
    if name == "post_local_sgd":
        return DDPHooksStrategy(
            comm_hook="post_local_sgd", local_sgd_period=2, local_sgd_warmup=3, local_group_size=1, **cap
        )
    if name == "hierarchical_sgd":
        return DDPHooksStrategy(comm_hook="hierarchical_sgd", hierarchy_levels={2: 2, 4: 4},
                                local_sgd_warmup=3, local_group_size=1, **cap)
    if name == "hierarchical_sgd_2":  # 2 ranks: one level, both ranks every 2 steps
        return DDPHooksStrategy(comm_hook="hierarchical_sgd", hierarchy_levels={2: 2}, local_sgd_warmup=3,
                                local_group_size=1, **cap)
    if name == "powersgd":
        return DDPHooksStrategy(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=3,
                                powersgd_min_compression_rate=1.0, **cap)
    return DDPHooksStrategy(comm_hook=name, **cap)


class _RandomTokens(LightningTransformer):
    """Lightning's demo Transformer on random (input, target) token blocks instead of a WikiText2 download."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.model.vocab_size, (64, 2, 35), generator=gen)
        return DataLoader(TensorDataset(tokens[:, 0], tokens[:, 1]), batch_size=2)


def _demo_fit(hook: str, devices: int, rec: pl.Callback) -> pl.Trainer:
    """The issue's setting: demo Transformer, 2 ranks, DDP's default buckets, the hook compressing from step
    3."""
    strategy = DDPHooksStrategy(comm_hook=hook, powersgd_start_iter=2, gradient_as_bucket_view=False)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[rec])
    trainer.fit(_RandomTokens())
    return trainer


def _buckets_seen(trainer: pl.Trainer) -> int | None:
    """How many DDP buckets PowerSGD handled (one error-feedback tensor per bucket), on every rank alike."""
    strategy = trainer.strategy
    if not isinstance(strategy, DDPHooksStrategy) or strategy.comm_hook != "powersgd":
        return None
    counts: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(counts, len(strategy.comm_state_dict()["powersgd"]["error_dict"]))
    assert len(set(counts)) == 1, counts
    return counts[0]


def _cli(config: str, extra: list[str]) -> LightningCLI:
    return LightningCLI(LlamaLM, MarkovDataModule, run=False, save_config_callback=None,
                        args=["--config", config, *extra])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", required=True)
    parser.add_argument(
        "--cli-extra", default="", help="space-separated LightningCLI overrides for cli: runs"
    )
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="DDP bucket size of the non-cli runs"
    )
    args = parser.parse_args()
    out_dir = Path(args.out).parent
    results: dict[str, Any] = {}
    for run in args.runs.split(","):
        pl.seed_everything(1234, workers=True)
        rec = Recorder()
        cap = args.bucket_cap_mb
        if run.startswith("demo:"):
            trainer = _demo_fit(run[5:], args.devices, rec)
            results[run] = {"rows": rec.rows, "global_step": trainer.global_step,
                            "buckets": _buckets_seen(trainer)}
            continue
        if run.startswith("cli:"):
            config = run[4:]
            cli = _cli(config, args.cli_extra.split())
            cli.trainer.callbacks.append(rec)
            cli.trainer.fit(cli.model, cli.datamodule)
            trainer = cli.trainer
        elif run.startswith("stall:"):
            # rank 1 stalls during local steps: rank 0 must not wait for it before the next averaging
            probe = StallProbe(out_dir / f"{run[6:]}.rank0_ahead")
            trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=_strategy(run[6:], cap),
                                 max_steps=12,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
            trainer.fit(LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA))
            results[run] = {"saw_rank0_ahead": probe.gathered}
            continue
        elif run.startswith("recap:"):
            # resume the checkpoint of an earlier ``resume:NAME`` run with DDP's default (one) bucket instead
            name = run[6:]
            root = out_dir / f"ckpt_{name}"
            trainer = _trainer(_strategy(name, 25.0), args.steps, args.devices, root / "recap", [rec])
            trainer.fit(
                LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA), ckpt_path=str(root / "step=6.ckpt")
            )
        elif run.startswith("resume:"):
            # continuous run with a checkpoint at step 6, then a second run resumed from it
            name = run[7:]
            root = out_dir / f"ckpt_{name}"
            ckpt_cb = ModelCheckpoint(
                dirpath=str(root), every_n_train_steps=6, save_top_k=-1, filename="{step}"
            )
            trainer = _trainer(_strategy(name, cap), args.steps, args.devices, root, [rec, ckpt_cb])
            trainer.fit(LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA))
            results[f"continuous:{name}"] = {"rows": rec.rows, "ckpt": str(root / "step=6.ckpt"),
                                             "val_in_sync": rec.val_in_sync, "save_in_sync": rec.save_in_sync}
            pl.seed_everything(1234, workers=True)
            rec = Recorder()
            trainer = _trainer(_strategy(name, cap), args.steps, args.devices, root, [rec])
            trainer.fit(
                LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA), ckpt_path=str(root / "step=6.ckpt")
            )
        elif run.startswith("acc"):  # accK:NAME -- accumulate_grad_batches=K, --steps optimizer steps
            accumulate, name = run[3:].split(":", 1)
            root = out_dir / run.replace(":", "_")
            trainer = _trainer(_strategy(name, cap), args.steps, args.devices, root, [rec],
                               accumulate=int(accumulate))
            trainer.fit(LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA))
        else:
            trainer = _trainer(_strategy(run, cap), args.steps, args.devices, out_dir / run, [rec])
            trainer.fit(LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA))
        params = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
        results[run] = {"rows": rec.rows, "params": params, "global_step": trainer.global_step,
                        "start_states": rec.start_states, "val_in_sync": rec.val_in_sync,
                        "buckets": _buckets_seen(trainer)}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
