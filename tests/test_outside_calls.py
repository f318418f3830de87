"""The model called outside the routed steps (issue: "the model dies when called outside a step").

``tests/workers/outside_calls.py`` fine-tunes a tiny HF Llama (a ``save_pretrained`` folder made here) and
calls the *inner* model as users do: ``self.model(...)`` in ``on_validation_epoch_end`` (eval mode) and
``on_train_end`` (train mode), ``pl_module.model.generate(...)`` in a callback, then ``trainer.validate`` and
``trainer.predict`` after ``fit`` and one more call. Every call's logits must equal a plain ``transformers``
model holding the same gathered weights (1e-5; TP reorders sums), and ``generate`` the same tokens, on every
rank of ``fsdp2``, ``hsdp``, ``fsdp2`` with tensor parallelism and ``ft_hsdp``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import WORKERS, run_python, run_torchrun

pytest.importorskip("transformers")
WORKER = WORKERS / "outside_calls.py"
EXPECTED = {"on_validation_epoch_end@0", "on_train_end", "after_fit"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune_hf import make_tiny

    return Path(make_tiny(str(tmp_path_factory.mktemp("outside") / "tiny"), "llama"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp2", "hsdp", "fsdp2_tp", "ft_hsdp"])
def test_the_inner_model_called_outside_the_steps_gives_the_unsharded_outputs(strategy: str, folder: Path,
                                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    if strategy == "ft_hsdp":
        run_python(["-m", "fsdp_strategies.ft", "--groups", "1", "--ranks-per-group", "2", "--events-dir",
                    str(tmp_path / "events"), "--timeout", "280", "--", str(WORKER), strategy, str(out),
                    str(folder)],
                   timeout=300)
    else:
        run_torchrun(WORKER, 2, [strategy, str(out), str(folder)], timeout=300)
    for rank in (0, 1):
        records = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        where = {r["where"] for r in records}
        assert where >= EXPECTED and any(w.startswith("callback_generate@") for w in where), where
        assert {r["training"] for r in records} == {True, False}, records  # train() and eval() mode both
        assert all(r["max_diff"] <= 1e-5 for r in records), records
        generated = [r["tokens_equal"] for r in records if r["tokens_equal"] is not None]
        assert generated and all(generated), records
