"""Pretrained Hugging Face weights straight into shards (issue #25, part 1).

Folders are written here with ``save_pretrained`` from tiny random configs (nothing is downloaded). The
multi-process runs train the example ``examples/finetune_hf.py`` with LightningCLI, as a user would, and a
probe callback records every rank's first batch and loss; the reference is ``transformers`` itself in this
process (``from_pretrained`` + the same batch), so a rank that started from anything but exactly the
pretrained weights -- random, a wrong key, an untied head, uninitialised rotary tables -- fails the 1e-5
check.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import ROOT, WORKERS, run_python
from conftest import _env as suite_env

transformers = pytest.importorskip("transformers")

from finetune_hf import make_tiny  # noqa: E402
from fsdp_strategies.hf.from_pretrained import defer_from_pretrained  # noqa: E402
from fsdp_strategies.hf.materialize import materialize  # noqa: E402
from fsdp_strategies.hf.pretrained import (  # noqa: E402
    PretrainedMismatchError,
    PretrainedSource,
    check_folder,
    load_pretrained,
)

EXAMPLE = str(ROOT / "examples" / "finetune_hf.py")
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_checkpointing", "false", "--trainer.max_steps", "1", "--data.num_train", "32"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    out = {arch: Path(make_tiny(str(root / arch), arch)) for arch in ("llama", "gpt2")}
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(out["llama"], dtype=torch.bfloat16)
    bf16.save_pretrained(root / "llama_bf16")
    out["llama_bf16"] = root / "llama_bf16"
    return out


class Holder(nn.Module):
    """A LightningModule-like owner: the HF model sits under ``self.model`` (keys prefixed ``model.``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.head_scale = nn.Parameter(torch.ones(1))  # a parameter outside the HF model


def _meta_holder(folder: Path, cls: type | None = None) -> Holder:
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = (cls or transformers.AutoModelForCausalLM).from_config(config, dtype=torch.float32)
        holder = Holder(model)
    materialize(holder, torch.device("cpu"))
    return holder


def _reference_loss(folder: Path, batch: torch.Tensor) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


# ---------------------------------------------------------------------------------------------- in one
# process
@pytest.mark.parametrize("arch", ["llama", "gpt2", "llama_bf16"])
def test_meta_build_materialise_and_load_gives_the_pretrained_model(
    arch: str, folders: dict[str, Path]
) -> None:
    # rotary tables (non-persistent buffers, never in the file) come from the model's own init; GPT-2's head
    # stays the embedding; a bf16 file lands in fp32 parameters as transformers' own upcast does
    holder = _meta_holder(folders[arch])
    report = load_pretrained(holder, PretrainedSource(str(folders[arch])))
    assert report["prefix"] == "model." and not report["missing"] and not report["unexpected"], report
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(holder.model(input_ids=x).logits, reference(input_ids=x).logits)
    assert next(holder.model.parameters()).dtype == torch.float32
    if arch == "gpt2":
        assert holder.model.lm_head.weight is holder.model.transformer.wte.weight


def test_clip_two_towers_and_a_0d_logit_scale_load(tmp_path: Path) -> None:
    cfg = transformers.CLIPConfig(
        text_config={"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 16, "patch_size": 8}, projection_dim=16)
    torch.manual_seed(0)
    reference = transformers.CLIPModel(cfg)
    with torch.no_grad():
        reference.logit_scale.fill_(2.5)  # not the init value: a load that skipped the scalar would show
    reference.save_pretrained(tmp_path)
    with torch.device("meta"):
        holder = Holder(transformers.CLIPModel(cfg))
    materialize(holder, torch.device("cpu"))
    report = load_pretrained(holder, PretrainedSource(str(tmp_path)))
    assert not report["missing"] and not report["unexpected"], report
    ids, pixels = torch.randint(0, 128, (2, 8)), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        got = holder.model(input_ids=ids, pixel_values=pixels).logits_per_image
        assert torch.equal(got, reference(input_ids=ids, pixel_values=pixels).logits_per_image)


def test_materialise_computes_the_buffers_a_checkpoint_never_holds(folders: dict[str, Path]) -> None:
    holder = _meta_holder(folders["llama"])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    assert torch.equal(holder.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_a_key_mismatch_names_the_keys_and_the_fix(folders: dict[str, Path]) -> None:
    # a sequence-classification model from a causal-LM folder: `score` is new, `lm_head` unused
    holder = _meta_holder(folders["llama"], transformers.AutoModelForSequenceClassification)
    with pytest.raises(PretrainedMismatchError) as err:
        load_pretrained(holder, PretrainedSource(str(folders["llama"]), origin="pretrained='x'"))
    text = str(err.value)
    assert "score.weight" in text and "lm_head.weight" in text and "pretrained_strict: false" in text, text
    # not strict (what from_pretrained itself does): the rest is loaded, the new head named in a warning
    with pytest.warns(UserWarning, match="score.weight"):
        report = load_pretrained(holder, PretrainedSource(str(folders["llama"]), strict=False))
    assert report["missing"] == ["score.weight"] and report["unexpected"] == ["lm_head.weight"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    assert torch.equal(holder.model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    # another architecture altogether: nothing matches
    with pytest.raises(PretrainedMismatchError, match="none of the"):
        load_pretrained(_meta_holder(folders["llama"]), PretrainedSource(str(folders["gpt2"]), strict=False))


def test_a_base_model_loads_from_its_task_model_folder(folders: dict[str, Path]) -> None:
    config = transformers.AutoConfig.from_pretrained(folders["llama"])
    with torch.device("meta"):
        holder = Holder(transformers.AutoModel.from_config(config))
    materialize(holder, torch.device("cpu"))
    with pytest.warns(UserWarning, match="lm_head.weight"):
        report = load_pretrained(holder, PretrainedSource(str(folders["llama"]), strict=False))
    assert not report["missing"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    assert torch.equal(
        holder.model.layers[1].mlp.up_proj.weight, reference.model.layers[1].mlp.up_proj.weight
    )


def test_bad_folders_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"pretrained='meta-llama/Llama-3.2-1B'.*hf download"):
        check_folder("meta-llama/Llama-3.2-1B", "pretrained")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"legacy pickle weights.*save_pretrained"):
        check_folder(tmp_path, "pretrained")
    from fsdp_strategies import FSDP2Strategy

    with pytest.raises(FileNotFoundError, match="pretrained="):  # at construction, before any process group
        FSDP2Strategy(pretrained=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"pretrained_prefix='model\.' without pretrained"):
        FSDP2Strategy(pretrained_prefix="model.")


def _damaged_copy(folder: Path, tmp: Path, case: str) -> tuple[Path, str]:
    """A copy of ``folder`` damaged as ``case``; returns it and the file the error must name."""
    import shutil

    out = tmp / case
    shutil.copytree(folder, out)
    weights, config = out / "model.safetensors", out / "config.json"
    if case == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])  # a copy cut short
        return out, str(weights)
    if case == "not-safetensors":
        weights.write_bytes(b"<html>404 Not Found</html>")  # an error page saved under the file's name
        return out, str(weights)
    if case == "no-config":
        config.unlink()
        return out, str(config)
    if case == "config-not-json":
        config.write_text(config.read_text()[:40])
        return out, str(config)
    assert case == "index-missing-shard"
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    return out, "model-00002-of-00002.safetensors"


@pytest.mark.parametrize(("case", "problem"), ids=lambda v: v if " " not in v else "", argvalues=[
    ("truncated", r"is damaged: safetensors cannot read it \(.*incomplete metadata.*\); a copy cut short"),
    ("not-safetensors", r"is damaged: safetensors cannot read it"),
    ("no-config", r"is missing \(the model's configuration\)"),
    ("config-not-json", r"is not valid JSON"),
    ("index-missing-shard", r"names 1 file\(s\) the folder lacks"),
])
def test_a_damaged_folder_is_named_at_construction(case: str, problem: str, folders: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """Before any process group: the strategy's own check names the option, the file and the problem."""
    from fsdp_strategies import FSDP2Strategy
    from fsdp_strategies.cli import option_error_line
    from fsdp_strategies.hf.pretrained import PretrainedFolderError

    folder, named = _damaged_copy(folders["llama"], tmp_path, case)
    with pytest.raises(PretrainedFolderError) as err:
        FSDP2Strategy(pretrained=str(folder))
    text = str(err.value)
    assert text.startswith(f"pretrained={str(folder)!r}: ") and named in text and "Fix: " in text, text
    assert re.search(problem, text), text
    line = option_error_line(err.value)
    assert line is not None and line.startswith("FSDP2Strategy: pretrained=") and "\n" not in line


def test_weights_of_another_size_name_the_tensors_and_the_config(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A model whose sizes differ from the weights: one error, before any weight is read, naming the tensors,
    their file and shapes -- and the config fields that differ when the model was built from another
    config."""
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(folders["llama"], edited)
    config = json.loads((edited / "config.json").read_text())
    config["intermediate_size"] *= 2
    (edited / "config.json").write_text(json.dumps(config))
    # the model built from the edited config.json: the file does not describe its weights
    with pytest.raises(PretrainedMismatchError) as err:
        load_pretrained(_meta_holder(edited), PretrainedSource(str(edited), origin="pretrained='x'"))
    text = str(err.value)
    size = config["intermediate_size"]
    assert re.search(r"pretrained='x': \d+ tensor\(s\) of .* have another shape than the module's", text), (
        text
    )
    assert re.search(rf"mlp\.up_proj\.weight \(model\.safetensors\): file \[{size // 2}, \d+\], model "
                     rf"\[{size}, \d+\]", text), text
    assert "does not describe the weights" in text and "restore the config.json" in text, text
    # a model built from another config than the (intact) folder's: the differing fields are named
    with pytest.raises(PretrainedMismatchError) as err:
        load_pretrained(
            _meta_holder(edited), PretrainedSource(str(folders["llama"]), origin="pretrained='y'")
        )
    assert f"intermediate_size: folder {size // 2}, model {size}" in str(err.value), str(err.value)


@pytest.mark.multiprocess
def test_damaged_folders_are_one_error_line_from_the_cli(tmp_path: Path, folders: dict[str, Path]) -> None:
    """Through LightningCLI, 2 ranks: a truncated weights file stops at construction (exit 2), weights that do
    not fit the model built from the folder's config stop on the ranks (exit 1); each one ``error:`` line, no
    traceback."""
    truncated, named = _damaged_copy(folders["llama"], tmp_path, "truncated")
    proc = run_python([EXAMPLE, "fit", "--config", "configs/finetune_hf_yaml_weights.yaml", *QUIET,
                       "--trainer.strategy.init_args.pretrained", str(truncated), "--model.pretrained",
                       str(folders["llama"])], check=False, timeout=300)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith(f"error: FSDP2Strategy: pretrained={str(truncated)!r}: {named} (") and \
        "is damaged" in errors[0], errors
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    edited = tmp_path / "edited"
    import shutil

    shutil.copytree(folders["llama"], edited)
    config = json.loads((edited / "config.json").read_text())
    config["intermediate_size"] *= 2
    (edited / "config.json").write_text(json.dumps(config))
    proc = run_python([EXAMPLE, "fit", "--config", "configs/finetune_hf_yaml_weights.yaml", *QUIET,
                       "--trainer.strategy.init_args.pretrained", str(edited), "--model.pretrained",
                       str(edited)],
                      check=False, timeout=300)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode == 1 and errors, proc.stderr[-4000:]
    assert all("have another shape than the module's" in e and "does not describe the weights" in e
               for e in errors), errors
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


def test_from_pretrained_under_meta_builds_on_meta_and_defers_the_weights(folders: dict[str, Path]) -> None:
    sources: list[PretrainedSource] = []
    with torch.device("meta"), defer_from_pretrained(sources):
        model = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"], dtype=torch.float32)
        with pytest.raises(ValueError, match=r"device_map='auto'.*Fix: drop device_map="):
            transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"], device_map="auto")
    assert all(p.is_meta for p in model.parameters()) and not model.training
    assert len(sources) == 1 and sources[0].target is model and not sources[0].strict
    # outside the meta device, and after the context, from_pretrained is transformers' own
    with defer_from_pretrained(sources):
        real = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"])
    assert not any(p.is_meta for p in real.parameters()) and len(sources) == 1
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta device"):
        transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"])


# ---------------------------------------------------------------------------------------------- real
# processes
def _probe_args(out: Path) -> list[str]:
    return ["--trainer.callbacks+=hf_probe.FirstStepProbe", f"--trainer.callbacks.init_args.out={out}"]


def _check_ranks(out: Path, folder: Path, ranks: int, tied: bool | None = None) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(records) == ranks, records
    for record in records:
        batch = torch.tensor(record["batch"])
        expected = _reference_loss(folder, batch)
        assert abs(record["loss"] - expected) <= 1e-5, (record["group"], record["rank"], record["loss"],
                                                        expected)
        assert record["dtype"] == "torch.float32"
        if tied is not None:
            assert record["tied"] is tied, record
    return records


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(WORKERS), suite_env()["PYTHONPATH"]])}


@pytest.mark.multiprocess
def test_fsdp2_from_pretrained_in_configure_model(tmp_path: Path, folders: dict[str, Path]) -> None:
    proc = run_python([EXAMPLE, "fit", "--config", "configs/finetune_hf.yaml", *QUIET,
                       "--model.pretrained", str(folders["llama"]), *_probe_args(tmp_path / "probe")],
                       env=_env())
    assert "built on the meta device" in proc.stdout + proc.stderr
    assert "read only its own shards" in proc.stdout + proc.stderr
    _check_ranks(tmp_path / "probe", folders["llama"], 2)


@pytest.mark.multiprocess
def test_fsdp2_weights_named_in_the_yaml_from_a_bf16_folder(tmp_path: Path, folders: dict[str, Path]) -> None:
    folder = str(folders["llama_bf16"])
    run_python([EXAMPLE, "fit", "--config", "configs/finetune_hf_yaml_weights.yaml", *QUIET,
                "--trainer.strategy.init_args.pretrained", folder, "--model.pretrained", folder,
                *_probe_args(tmp_path / "probe")], env=_env())
    _check_ranks(tmp_path / "probe", folders["llama_bf16"], 2)


@pytest.mark.multiprocess
def test_hsdp_2x2_gpt2_keeps_its_tie(tmp_path: Path, folders: dict[str, Path]) -> None:
    run_python([EXAMPLE, "fit", "--config", "configs/finetune_hf.yaml", *QUIET, "--trainer.devices", "4",
                "--trainer.strategy", "hsdp", "--model.pretrained", str(folders["gpt2"]),
                "--trainer.enable_checkpointing", "true", "--trainer.default_root_dir", str(tmp_path / "run"),
                *_probe_args(tmp_path / "probe")], env=_env(), timeout=400)
    _check_ranks(tmp_path / "probe", folders["gpt2"], 4, tied=True)
    # the 2x2 checkpoint exports as a GPT-2 folder: the head written once, tied again on load
    from fsdp_strategies import export_consolidated, export_hf

    ckpt = next((tmp_path / "run").rglob("*.ckpt"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf"))
    assert exported.lm_head.weight is exported.transformer.wte.weight
    state = torch.load(export_consolidated(ckpt, tmp_path / "plain.pt", "model."), weights_only=True)
    assert torch.equal(exported.transformer.wte.weight, state["transformer.wte.weight"])
    assert torch.equal(exported.lm_head.weight, state["lm_head.weight"])


@pytest.mark.multiprocess
def test_ft_hsdp_two_groups_start_from_the_pretrained_weights(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    # min_replica_size 2: the first step waits for both groups, so each trains its first batch (a group that
    # came later would heal from its peer instead of training from the file)
    strategy = ["--trainer.strategy", "fsdp_strategies.FTHSDPStrategy",
                "--trainer.strategy.init_args.timeout_s",
                "10", "--trainer.strategy.init_args.connect_timeout_s", "5",
                "--trainer.strategy.init_args.min_replica_size", "2"]
    run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "1",
                "--heartbeat-timeout-ms",
                "1000", "--join-timeout-ms", "30000", "--events-dir", str(tmp_path / "events"), "--timeout",
                "280",
                "--", EXAMPLE, "fit", "--config", "configs/finetune_hf.yaml", *QUIET, "--trainer.devices",
                "1", *strategy, "--trainer.max_steps", "3", "--model.pretrained", str(folders["llama"]),
                *_probe_args(tmp_path / "probe")], env=_env(), timeout=300)
    records = _check_ranks(tmp_path / "probe", folders["llama"], 2)
    assert sorted(r["group"] for r in records) == ["0", "1"]


@pytest.mark.multiprocess
@pytest.mark.torch_range
def test_worked_example_finetune_export_reload(tmp_path: Path, folders: dict[str, Path]) -> None:
    # the example as its docstring runs it: fine-tune under fsdp2 (2 ranks, a sharded checkpoint), then
    # `fsdp-strategies-export CKPT OUT --format hf` and transformers' own from_pretrained on OUT
    import shutil

    run_python([EXAMPLE, "fit", "--config", "configs/finetune_hf.yaml", "--trainer.logger", "false",
                "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "4", "--data.num_train",
                "32",
                "--trainer.default_root_dir", str(tmp_path), "--model.pretrained", str(folders["llama"])])
    ckpt = next(tmp_path.rglob("*.ckpt"))
    script = shutil.which("fsdp-strategies-export", path=str(Path(sys.executable).parent))
    assert script, "the console script is installed with the package (pip install -e .)"
    out = tmp_path / "hf"
    # no --prefix, no --hf-config: recorded
    proc = run_python([script, str(ckpt), str(out), "--format", "hf"])
    assert out.is_dir() and (out / "config.json").is_file(), proc.stdout + proc.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # the reference: the checkpoint's own weights (the torch export) in the pretrained architecture
    plain = tmp_path / "plain.pt"
    run_python([script, str(ckpt), str(plain), "--strip-prefix", "model."])
    trained = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.float32)
    trained.load_state_dict(torch.load(plain, weights_only=True))
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.float32)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want, before = (m(input_ids=x).logits for m in (exported, trained, pretrained))
    assert (got - want).abs().max() <= 1e-5
    assert (want - before).abs().max() > 1e-4, (
        "the fine-tune changed nothing: the comparison would prove nothing"
    )
