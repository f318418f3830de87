"""``fsdp-strategies-export --format hf``: checkpoints back into Hugging Face ``save_pretrained`` folders.

One module-scoped torchrun job (2 ranks, gloo; tests/workers/hf_export_train.py) fine-tunes tiny pretrained
``transformers`` models (saved with ``save_pretrained`` here, nothing downloaded) -- Llama (untied), GPT-2
(``wte``/``lm_head`` tied) and T5 (two stacks, embeddings shared four ways) -- held under ``self.model`` of a
LightningModule, under ``fsdp2`` (sharded folder and full file), ``ddp_hooks`` and Lightning's ``ddp`` (full
files), and records the trained module's logits on a fixed batch. Every export below is loaded back with
``AutoModelFor...from_pretrained(OUT)`` and compared with those logits (1e-5, fp32).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_strategies.hf.export as hf_export
from conftest import ROOT, WORKERS, run_python, run_torchrun
from fsdp_strategies.checkpoint.integrity import MANIFEST_FILE, CheckpointIntegrityError
from fsdp_strategies.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from fsdp_strategies.hf.export import HFExportError, export_hf, main, parse_size
from fsdp_strategies.hf.metadata import HF_METADATA_KEY, hf_checkpoint_metadata
from matrix.models import _gpt2, _llama, _t5
from workers.hf_export_train import RUNS, probe_batch

BUILDERS = {"llama": _llama, "gpt2": _gpt2, "t5": _t5}
TOL = 1e-5
SHARDED = ["llama_fsdp2_sharded", "gpt2_fsdp2_sharded", "t5_fsdp2_sharded"]
#: the runs whose strategy records the HF model in the checkpoint (fsdp2: once the save hook calls
#: hf_checkpoint_metadata; ddp_hooks does already). Lightning's own ddp records nothing.
RECORDING = [*SHARDED, "llama_fsdp2_full", "t5_ddp_hooks_full"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("hf_export")
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        build().save_pretrained(work / "pretrained" / name)
    (work / "runs").mkdir()
    run_torchrun(WORKERS / "hf_export_train.py", 2, ["--work", str(work)], timeout=600)
    return work


def _auto_class(model: str) -> Any:
    import transformers

    return transformers.AutoModelForSeq2SeqLM if model == "t5" else transformers.AutoModelForCausalLM


def _max_diff(job: Path, run: str, out: Path) -> float:
    """Load ``out`` with transformers and compare its logits with the trained module's (from the worker)."""
    model = RUNS[run][0]
    loaded = _auto_class(model).from_pretrained(out)
    with torch.no_grad():
        logits = loaded(**probe_batch(model)).logits
    trained = torch.load(job / "runs" / f"{run}.logits.pt")
    diff = (logits - trained).abs().max().item()
    print(f"{run}: max |logits(from_pretrained(export)) - logits(trained module)| = {diff:.3g}")
    return diff


def _nothing_left(out: Path) -> bool:
    return not out.exists() and not out.with_name(out.name + ".tmp").exists() and \
        not out.with_name(f".{out.name}.tmp.lock").exists()


def _safetensors_keys(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update({k: f.get_slice(k).get_dtype() for k in f.keys()})  # noqa: SIM118
    return found


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.multiprocess
@pytest.mark.parametrize("run", [*SHARDED, "llama_fsdp2_full", "t5_ddp_hooks_full", "gpt2_ddp_full"])
def test_round_trip_with_the_pretrained_config(job: Path, tmp_path: Path, run: str) -> None:
    """pretrained -> fine-tune -> checkpoint -> --format hf --hf-config PRETRAINED -> from_pretrained: same
    logits. The prefix is found from the keys (Lightning's ddp records no model)."""
    model = RUNS[run][0]
    out = tmp_path / "hf"
    assert main([str(job / "runs" / f"{run}.ckpt"), str(out), "--format", "hf",
                 "--hf-config", str(job / "pretrained" / model)]) == 0
    assert _max_diff(job, run, out) <= TOL
    # ... and training moved the weights: the pretrained model's logits are far off
    pretrained = _auto_class(model).from_pretrained(job / "pretrained" / model)
    with torch.no_grad():
        before = pretrained(**probe_batch(model)).logits
    assert (before - torch.load(job / "runs" / f"{run}.logits.pt")).abs().max().item() > 0.1


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RECORDING)
def test_round_trip_from_the_recorded_metadata(job: Path, tmp_path: Path, run: str) -> None:
    """No --hf-config: the class, config and prefix come from the checkpoint itself (fails where the
    strategy's save does not call hf_checkpoint_metadata)."""
    out = tmp_path / "hf"
    assert export_hf(job / "runs" / f"{run}.ckpt", out) == out
    assert _max_diff(job, run, out) <= TOL
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [
        json.loads((job / "pretrained" / RUNS[run][0] / "config.json").read_text())["architectures"][0]
    ]
    assert (out / "generation_config.json").is_file()


@pytest.mark.multiprocess
def test_export_from_object_storage_gives_the_same_model(job: Path, tmp_path: Path) -> None:
    """A committed checkpoint at an fsspec URL (``memory://``, in this process; tests/test_object_store.py
    runs the torch format against a real S3 server) exports to the same Hugging Face model as the local one,
    read from its recorded metadata."""
    from fsdp_strategies.checkpoint.export import read_sharded_state_dict
    from fsdp_strategies.checkpoint.object_store import open_remote, save_sharded_remote

    run = "llama_fsdp2_sharded"
    local = job / "runs" / f"{run}.ckpt"
    url = f"memory://hf-export-{os.getpid()}/{run}.ckpt"
    meta = safe_torch_load(local / "meta.pt")
    save_sharded_remote({"state_dict": read_sharded_state_dict(local)}, meta, open_remote(url, "url"),
                        is_rank_zero=True)
    assert main([url, str(tmp_path / "remote"), "--format", "hf"]) == 0
    assert _max_diff(job, run, tmp_path / "remote") <= TOL
    assert export_hf(local, tmp_path / "local") == tmp_path / "local"
    assert _safetensors_keys(tmp_path / "remote") == _safetensors_keys(tmp_path / "local")


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["llama_fsdp2_sharded", "gpt2_fsdp2_sharded", "t5_fsdp2_sharded"])
def test_layout_and_tied_weights_are_save_pretrained_s(job: Path, tmp_path: Path, run: str) -> None:
    """The same files and keys as transformers' own save_pretrained: each tied weight once (GPT-2 keeps wte,
    T5 keeps shared), untied Llama keeps lm_head."""
    model = RUNS[run][0]
    out = tmp_path / "hf"
    export_hf(job / "runs" / f"{run}.ckpt", out, hf_config=job / "pretrained" / model)
    reference = job / "pretrained" / model
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert _safetensors_keys(out) == _safetensors_keys(reference)
    keys = _safetensors_keys(out)
    if model == "gpt2":
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    if model == "t5":
        assert "shared.weight" in keys and not {"lm_head.weight", "encoder.embed_tokens.weight",
                                                "decoder.embed_tokens.weight"} & set(keys)
    if model == "llama":
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(keys)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["gpt2_fsdp2_sharded", "t5_ddp_hooks_full"])
def test_sharded_export_loads_the_same(job: Path, tmp_path: Path, run: str) -> None:
    out = tmp_path / "hf"
    assert main([str(job / "runs" / f"{run}.ckpt"), str(out), "--format", "hf", "--max-shard-size", "40KB",
                 "--hf-config", str(job / "pretrained" / RUNS[run][0])]) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert set(index["weight_map"]) == set(_safetensors_keys(out))
    from safetensors import safe_open

    for file in files:  # no file holds more than the threshold, unless it is one tensor larger than it
        with safe_open(str(out / file), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]  # noqa: SIM118
        assert sum(sizes) <= 40_000 or len(sizes) == 1, (file, sizes)
    assert _max_diff(job, run, out) <= TOL


@pytest.mark.multiprocess
def test_dtype_option_casts_and_config_follows(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    run = "llama_fsdp2_sharded"
    export_hf(job / "runs" / f"{run}.ckpt", out, hf_config=job / "pretrained" / "llama", dtype="bf16")
    assert set(_safetensors_keys(out).values()) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    fp32 = tmp_path / "fp32"
    export_hf(job / "runs" / f"{run}.ckpt", fp32, hf_config=job / "pretrained" / "llama")
    loaded = _auto_class("llama").from_pretrained(out)
    reference = _auto_class("llama").from_pretrained(fp32)
    assert loaded.dtype == torch.bfloat16
    for (name, value), ref in zip(loaded.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, ref.to(torch.bfloat16)), name


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_damaged_checkpoint_is_refused(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         kind: str) -> None:
    run = "gpt2_fsdp2_sharded" if kind == "sharded" else "llama_fsdp2_full"
    source = job / "runs" / f"{run}.ckpt"
    damaged = tmp_path / "damaged.ckpt"
    (shutil.copytree if kind == "sharded" else shutil.copyfile)(source, damaged)
    victim = damaged / "__0_0.distcp" if kind == "sharded" else damaged
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "hf"
    assert main([str(damaged), str(out), "--format", "hf", "--hf-config",
                 str(job / "pretrained" / RUNS[run][0])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fsdp-strategies-export: error: ") and "corrupt" in err[0], err
    assert _nothing_left(out)


@pytest.mark.multiprocess
def test_a_key_mismatch_names_the_keys_and_the_fix(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    # the config of another model: Llama's names are missing, GPT-2's are unexpected
    with pytest.raises(HFExportError) as err:
        export_hf(job / "runs" / "gpt2_fsdp2_sharded.ckpt", out, hf_config=job / "pretrained" / "llama",
                  prefix="model.")
    message = str(err.value)
    assert "LlamaForCausalLM under the prefix 'model.'" in message
    assert "missing in the checkpoint: model.embed_tokens.weight" in message, message
    assert "in the checkpoint but not in the model: transformer.wte.weight" in message, message
    assert "Fix: pass --prefix" in message
    assert _nothing_left(out)
    # a prefix the module does not have: everything is missing
    with pytest.raises(HFExportError, match=r"under the prefix 'student\.': missing in the checkpoint: "):
        export_hf(job / "runs" / "gpt2_fsdp2_sharded.ckpt", out, hf_config=job / "pretrained" / "gpt2",
                  prefix="student")
    # a recorded checkpoint asked for a model it does not record
    with pytest.raises(
        HFExportError, match=r"prefix='student\.'.*records Hugging Face models under 'model\.' only"
    ):
        export_hf(job / "runs" / "t5_ddp_hooks_full.ckpt", out, prefix="student.")
    # Lightning's ddp records nothing: the error says to pass --hf-config
    with pytest.raises(HFExportError, match=r"records no Hugging Face model.*Fix: pass --hf-config DIR"):
        export_hf(job / "runs" / "gpt2_ddp_full.ckpt", out)
    assert _nothing_left(out)


@pytest.mark.multiprocess
def test_a_failure_while_writing_leaves_nothing(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = hf_export._write_safetensors

    def write_then_fail(folder: Path, *args: Any) -> int:
        real(folder, *args)
        assert any(folder.glob("*.safetensors"))  # it got as far as writing the weights
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(hf_export, "_write_safetensors", write_then_fail)
    out = tmp_path / "hf"
    with pytest.raises(OSError, match="No space left"):
        export_hf(job / "runs" / "llama_fsdp2_sharded.ckpt", out, hf_config=job / "pretrained" / "llama")
    assert _nothing_left(out)


@pytest.mark.multiprocess
def test_an_existing_output_is_never_overwritten(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(HFExportError, match="already exists"):
        export_hf(job / "runs" / "llama_fsdp2_sharded.ckpt", out, hf_config=job / "pretrained" / "llama")
    assert [p.name for p in out.iterdir()] == ["tokenizer.json"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_hf(job / "runs" / "llama_fsdp2_sharded.ckpt", empty, hf_config=job / "pretrained" / "llama")
    assert (empty / "model.safetensors").is_file()


class _Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.multiprocess
def test_a_hostile_meta_file_is_never_unpickled(job: Path, tmp_path: Path) -> None:
    """The sharded folder's meta.pt (where the record lives) is read with the restricted unpickler, even with
    a manifest rewritten to match it."""
    import hashlib

    marker = tmp_path / "pwned"
    folder = tmp_path / "evil.ckpt"
    shutil.copytree(job / "runs" / "llama_fsdp2_sharded.ckpt", folder)
    torch.save({"payload": _Payload(marker)}, folder / "meta.pt")
    out = tmp_path / "hf"
    with pytest.raises(CheckpointIntegrityError, match=r"meta\.pt"):
        export_hf(folder, out, hf_config=job / "pretrained" / "llama")
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    data = (folder / "meta.pt").read_bytes()
    manifest["files"]["meta.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(UnsafeCheckpointError, match="refused to load"):
        export_hf(folder, out, hf_config=job / "pretrained" / "llama")
    assert not marker.exists() and _nothing_left(out)


# ------------------------------------------------------------------------------------------- the command
@pytest.mark.multiprocess
def test_the_command_keeps_the_torch_format_as_its_default(job: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plain.pt"
    assert main([str(job / "runs" / "gpt2_fsdp2_sharded.ckpt"), str(out), "--strip-prefix", "model."]) == 0
    state = torch.load(out, weights_only=True)
    assert "transformer.wte.weight" in state and "lm_head.weight" in state
    assert (
        main([str(job / "runs" / "gpt2_fsdp2_sharded.ckpt"), str(tmp_path / "x.pt"), "--prefix", "model."])
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fsdp-strategies-export: error: --prefix: only for --format hf. Fix: add --format hf, or drop "
        "it (--format torch takes --strip-prefix)."
    ]
    assert main([str(job / "runs" / "gpt2_fsdp2_sharded.ckpt"), str(tmp_path / "y"), "--format", "hf",
                 "--strip-prefix", "model."]) == 1
    assert "use --prefix with --format hf" in capsys.readouterr().err


def test_the_console_script_runs_the_command_with_both_formats() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'fsdp-strategies-export = "fsdp_strategies.hf.export:main"' in pyproject.splitlines()


@pytest.mark.parametrize(
    ("value", "expected"),
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("40KB", 40_000), (123, 123), ("2.5gb", 2_500_000_000)],
)
def test_sizes_read_as_transformers_reads_them(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["five", "0GB", "-1", "5XB", 0])
def test_a_bad_size_or_dtype_names_the_option(value: int | str, tmp_path: Path) -> None:
    with pytest.raises(HFExportError, match=r"max_shard_size=.* is not a size\. Fix:"):
        export_hf(tmp_path / "missing.ckpt", tmp_path / "out", max_shard_size=value)
    with pytest.raises(
        HFExportError, match=r"dtype='int8' is not supported\. Fix: use one of bf16, fp16, fp32"
    ):
        export_hf(tmp_path / "missing.ckpt", tmp_path / "out", dtype="int8")


# ------------------------------------------------------------------------------------------- the record
def _lightning_module(**models: torch.nn.Module) -> torch.nn.Module:
    import lightning.pytorch as pl

    module = pl.LightningModule()
    for name, model in models.items():
        setattr(module, name, model)
    return module


def test_the_record_names_outermost_models_with_their_state_dict_prefix() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    t5, gpt2, llama = _t5(), _gpt2(), _llama()
    module = _lightning_module(model=t5, student=checkpoint_wrapper(gpt2), teacher=torch.compile(llama))
    records = hf_checkpoint_metadata(module)[HF_METADATA_KEY]
    # T5's stacks (T5Stack) and GPT-2's transformer (GPT2Model) are PreTrainedModels too, but inside another
    # one
    assert [(r["prefix"], r["class_name"]) for r in records] == [
        ("model.", "T5ForConditionalGeneration"),
        ("student.", "GPT2LMHeadModel"),  # the checkpoint wrapper's state-dict hook drops its token
        ("teacher._orig_mod.", "LlamaForCausalLM"),  # torch.compile's token stays in the state dict
    ]
    keys = set(module.state_dict())
    for record, model in zip(records, (t5, gpt2, llama)):
        assert {record["prefix"] + k for k in model.state_dict()} <= keys
        assert json.loads(record["config"]) == json.loads(model.config.to_json_string())
        assert json.loads(record["generation_config"]) == json.loads(model.generation_config.to_json_string())


def test_the_record_reads_back_with_the_restricted_unpickler(tmp_path: Path) -> None:
    entry = hf_checkpoint_metadata(_lightning_module(model=_gpt2()))
    torch.save({"epoch": 1, **entry}, tmp_path / "meta.pt")
    assert safe_torch_load(tmp_path / "meta.pt") == {"epoch": 1, **entry}


def test_no_record_without_an_hf_model() -> None:
    gpt2 = _gpt2()
    assert hf_checkpoint_metadata(_lightning_module(net=torch.nn.Linear(2, 2))) == {}
    # the module is the model
    assert [r["prefix"] for r in hf_checkpoint_metadata(gpt2)[HF_METADATA_KEY]] == [""]


@pytest.mark.subprocess
def test_the_record_does_not_import_transformers_models() -> None:
    code = ("import sys, torch; from fsdp_strategies.hf.metadata import hf_checkpoint_metadata; "
            "assert hf_checkpoint_metadata(torch.nn.Linear(2, 2)) == {}; "
            "assert 'transformers.modeling_utils' not in sys.modules, 'imported'")
    run_python(["-c", code], timeout=120)
