"""A short 2-rank job that must exit 0: the ``terminate called without an active exception`` check.

Modes:
  collectives  plain torch.distributed (gloo): 200 synchronous all-reduces, then the end of the script --
               the pattern that aborts at interpreter exit without fsdp_strategies' exit handling (4-6 of
               10 two-rank runs here); ``import fsdp_strategies`` installs it, ``--without-fix`` leaves it out
               (the control). One rank per process: RANK/WORLD_SIZE/MASTER_* from the environment (torchrun,
               or a test that starts both ranks). (Forking the jobs from one process does not reproduce the
               abort.)
  lightning    ``fsdp2`` (or ``--strategy``) through Lightning's launcher: fit, validate, test and predict of
               a tiny Llama, then the end of the script.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def collectives(with_fix: bool) -> None:
    import torch
    import torch.distributed as dist

    if with_fix:
        import fsdp_strategies  # noqa: F401  (registers the clean-exit handling at import)
    global tensor  # the last one stays referenced until the interpreter's teardown, as in a plain script
    dist.init_process_group("gloo")
    for _ in range(200):
        tensor = torch.ones(1000)
        dist.all_reduce(tensor)


def lightning(strategy: str, root: Path) -> None:
    import lightning.pytorch as pl

    import fsdp_strategies  # noqa: F401
    from llama import LlamaLM, MarkovDataModule

    class EvalLM(LlamaLM):
        def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.validation_step(batch, batch_idx)

    pl.seed_everything(0)
    model = EvalLM(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    data = MarkovDataModule(vocab_size=64, seq_len=32, batch_size=4, num_train=64, num_val=16)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
                         default_root_dir=str(root))
    trainer.fit(model, data)
    trainer.validate(model, data)
    trainer.test(model, data.val_dataloader())
    trainer.predict(model, data.val_dataloader())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("collectives", "lightning"))
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--root", type=Path, default=Path("outputs/exit_job"))
    parser.add_argument("--without-fix", action="store_true")
    args = parser.parse_args()
    if args.mode == "collectives":
        collectives(with_fix=not args.without_fix)
    else:
        lightning(args.strategy, args.root)


if __name__ == "__main__":
    main()
