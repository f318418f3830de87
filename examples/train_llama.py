"""Train the example Llama LM with LightningCLI.

    python examples/train_llama.py fit --config configs/fsdp2.yaml
    python examples/train_llama.py fit --config configs/hsdp.yaml --trainer.max_steps 50

``import fsdp_strategies`` registers the strategy names (fsdp2, hsdp, ...) and makes the
callbacks importable by ``class_path``; the model and data modules are plain Lightning.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp_strategies  # noqa: F401  (registers strategy names)
from fsdp_strategies.cli import ArgumentParser
from llama import LlamaLM, MarkovDataModule


def main(args: list[str] | None = None) -> LightningCLI:
    # ArgumentParser: a bad option value or name is reported first, with its valid values and a fix
    return LightningCLI(LlamaLM, MarkovDataModule, args=args, save_config_kwargs={"overwrite": True},
                        parser_class=ArgumentParser)


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_initialized():  # gloo subgroups left to interpreter exit can abort the process (SIGABRT)
        dist.destroy_process_group()
