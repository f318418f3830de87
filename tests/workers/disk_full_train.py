"""Worker for tests/test_disk_full.py: train the example Llama with a ModelCheckpoint on a (small) filesystem.

Started under torchrun (one process per rank, gloo), so a failing rank is not SIGKILLed by Lightning's
own launcher before the other ranks print their error:

    torchrun --nproc_per_node=2 disk_full_train.py --dir CKPT_DIR --strategy fsdp2 --async off --steps 6

``--every N`` saves ``last.ckpt`` every N steps (``save_last=True``, ``save_top_k=0``), so with a filesystem
that holds one checkpoint but not two, the second save runs out of space. ``--resume PATH`` instead resumes
from PATH with no checkpointing and prints ``RESUMED <rank> global_step=<n>`` when the fit ends.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy, HSDPStrategy
from llama import LlamaLM, MarkovDataModule

MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-2,
         "warmup_steps": 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--strategy", choices=("fsdp2", "hsdp", "ddp_hooks"), default="fsdp2")
    parser.add_argument("--async", dest="async_mode", choices=("off", "thread", "process"), default="off")
    parser.add_argument("--full-file", action="store_true", help="save_distributed_checkpoint=False")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    options = {"block_class_names": ["TransformerBlock"], "async_checkpoint": args.async_mode,
               "save_distributed_checkpoint": not args.full_file}
    if args.strategy == "ddp_hooks":  # full files always; no block wrapping
        strategy: Any = DDPHooksStrategy(async_checkpoint=args.async_mode)
    elif args.strategy == "hsdp":
        strategy = HSDPStrategy(replicate_degree=2, shard_degree=1, **options)
    else:
        strategy = FSDP2Strategy(**options)
    callbacks = [] if args.resume else [ModelCheckpoint(dirpath=args.dir, save_last=True, save_top_k=0,
                                                        every_n_train_steps=args.every)]
    pl.seed_everything(3)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=not args.resume, callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=args.dir)
    data = MarkovDataModule(vocab_size=64, seq_len=32, batch_size=4, num_train=64, num_val=8, shuffle=False)
    trainer.fit(LlamaLM(**MODEL), data, ckpt_path=args.resume)
    if args.resume:
        print(f"RESUMED {trainer.global_rank} global_step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
