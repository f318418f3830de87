"""``--help`` of the example CLI lists every strategy option once declared, with its type and default.

Options are declared once (``fsdp2``'s) and reach ``hsdp`` / ``ft_hsdp`` through ``**kwargs``; this
checks that jsonargparse still resolves them for LightningCLI, in process (no training, no subprocess).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

import fsdp_strategies
import train_llama
from fsdp_strategies.strategies.fsdp2 import FSDP2Strategy


def _options(cls: type) -> dict[str, Any]:
    """``__init__`` parameters, following ``**kwargs`` into the parents (what the help must list)."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or not klass.__module__.startswith("fsdp_strategies"):
            continue
        params = inspect.signature(klass.__init__).parameters
        for name, p in params.items():
            if name != "self" and p.kind is not p.VAR_KEYWORD and name not in out:
                out[name] = p.default
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return out


def _help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        train_llama.main(list(args))
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["FSDP2Strategy", "HSDPStrategy", "FTHSDPStrategy", "DDPHooksStrategy"])
def test_strategy_help_lists_every_option_with_type_and_default(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    cls = getattr(fsdp_strategies, name)
    text = re.sub(r"\s+", " ", _help(capsys, "fit", "--trainer.strategy.help", f"fsdp_strategies.{name}"))
    text = text.split("Help for --trainer.strategy.help", 1)[1]  # the descriptions (not the usage line)
    options = _options(cls)
    if cls is not FSDP2Strategy and issubclass(cls, FSDP2Strategy):
        # the fsdp2 options come through **kwargs, declared once
        assert set(_options(FSDP2Strategy)) <= set(options)
    if name == "FTHSDPStrategy":  # ft_hsdp passes replicate_degree=1 to hsdp: not an option of it
        assert "--trainer.strategy.replicate_degree" not in text
        del options["replicate_degree"]
    for option, default in options.items():
        found = re.search(rf"--trainer\.strategy\.{option} .*?\(type: (.*?), default: (.*?)\)", text)
        assert found, option
        assert found.group(1), option
        assert found.group(2) == ("null" if default is None else str(default)), (option, found.groups())


def test_fit_help_lists_the_strategy_and_callback_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "fit", "--help")
    for option in ("--trainer.strategy", "--trainer.callbacks", "--trainer.precision", "--model.dim", "--data.batch_size"):
        assert option in text, option
