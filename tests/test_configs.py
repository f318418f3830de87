"""Every YAML in configs/ runs through the example's LightningCLI for a few steps (real processes)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_python
from fsdp_strategies import FSDP2Strategy

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# Configs that need more than one Lightning job (a lighthouse + replica groups) run in their own tests.
COVERED_ELSEWHERE = {"ft_hsdp.yaml": "test_ft_hsdp.py", "ft_hsdp_diloco.yaml": "test_ft_sync.py",
                     "ft_hsdp_local_sgd.yaml": "test_ft_sync.py",
                     "ft_hsdp_straggler_sync.yaml": "test_ft_switch.py",
                     "ft_hsdp_tp.yaml": "test_ft_tensor_parallel.py",
                     "sac_budget.yaml": "test_memory_budget.py",
                     # the Hugging Face fine-tune runs examples/finetune_hf.py on a save_pretrained folder it
                     # writes
                     "finetune_hf.yaml": "test_hf_pretrained.py",
                     "finetune_hf_yaml_weights.yaml": "test_hf_pretrained.py"}


def test_configs_exist() -> None:
    assert {"fsdp2.yaml", "fsdp2_class_path.yaml", "hsdp.yaml"} <= {c.name for c in CONFIGS}


def test_every_config_is_listed_in_getting_started() -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    missing = [c.name for c in CONFIGS if f"`configs/{c.name}`" not in text]
    assert not missing, f"docs/getting-started.md's configs table lacks: {missing}"


def test_the_class_path_config_spells_out_every_fsdp2_option() -> None:
    options = set(inspect.signature(FSDP2Strategy.__init__).parameters) - {"self", "kwargs"}
    config = yaml.safe_load((ROOT / "configs" / "fsdp2_class_path.yaml").read_text())
    spelled = set(config["trainer"]["strategy"]["init_args"])
    assert not sorted(options - spelled), f"fsdp2_class_path.yaml lacks: {sorted(options - spelled)}"


def test_no_config_names_a_test_helper() -> None:
    """configs/ is what users copy: fault and slowness injectors live in tests and demo overlays
    (examples/)."""
    offenders = [c.name for c in CONFIGS if "fsdp_strategies.testing" in c.read_text()]
    assert not offenders, f"configs naming fsdp_strategies.testing: {offenders}"


@pytest.mark.parametrize("name", sorted(COVERED_ELSEWHERE))
def test_config_is_covered_by_its_own_test(name: str) -> None:
    if not (ROOT / "configs" / name).exists():
        pytest.skip(f"{name} is not part of this checkout")
    assert name in (ROOT / "tests" / COVERED_ELSEWHERE[name]).read_text()


# GPU-sized configs keep every trainer/strategy option but run on 2 CPU ranks with a tiny model.
SHRINK_GPU = ["--trainer.devices", "2", "--model.vocab_size", "128", "--model.dim", "64", "--model.n_layers",
              "2", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.mlp_hidden", "128",
              "--model.max_seq_len", "32",
              "--data.vocab_size", "128", "--data.seq_len", "32", "--data.num_train", "256", "--data.num_val",
              "16"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c.name not in COVERED_ELSEWHERE], ids=lambda c: c.stem
)
def test_config_trains_a_few_steps(config: Path, tmp_path: Path) -> None:
    shrink = SHRINK_GPU if "_gpu" in config.name else []
    proc = run_python(
        ["examples/train_llama.py", "fit", "--config", str(config), "--trainer.max_steps", "3",
         "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
         "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false", *shrink],
        timeout=400,
    )
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in proc.stdout + proc.stderr
    trainer_cfg = yaml.safe_load(config.read_text()).get("trainer", {})
    if trainer_cfg.get("enable_checkpointing", True) and "callbacks" not in trainer_cfg:
        # Lightning's default ModelCheckpoint wrote through the strategy's save_checkpoint.
        assert list(tmp_path.rglob("*.ckpt")), f"{config.name}: no checkpoint was written"
    strategy_args = (trainer_cfg.get("strategy") or {}).get("init_args", {}) if isinstance(
        trainer_cfg.get("strategy"), dict) else {}
    if strategy_args.get("async_checkpoint") not in (None, "off", False):
        # background writes: fit returned after the last one committed -- complete, verified, no temp left
        from fsdp_strategies import verify_checkpoint

        written = list(tmp_path.rglob("*.ckpt"))
        assert written and all(verify_checkpoint(p).ok for p in written), written
        assert not list(tmp_path.rglob("*.tmp")), list(tmp_path.rglob("*.tmp"))
