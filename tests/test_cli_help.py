"""``--help`` of the example CLI lists every strategy option once declared, with its type and default.

Options are declared once (``fsdp2``'s) and reach ``hsdp`` / ``ft_hsdp`` through ``**kwargs``; this
checks that jsonargparse still resolves them for LightningCLI, in process (no training, no subprocess).
The launcher ``fsdp-strategies-ft`` derives its flags from ``LaunchOptions``: its ``--help`` lists each one
with the help text and default declared there.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
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
def test_strategy_help_lists_every_option_with_type_and_default(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cls = getattr(fsdp_strategies, name)
    text = re.sub(r"\s+", " ", _help(capsys, "fit", "--trainer.strategy.help", f"fsdp_strategies.{name}"))
    text = text.split("Help for --trainer.strategy.help", 1)[1]  # the descriptions (not the usage line)
    options = _options(cls)
    if cls is not FSDP2Strategy and issubclass(cls, FSDP2Strategy):
        # the fsdp2 options come through **kwargs, declared once
        assert set(_options(FSDP2Strategy)) <= set(options)
    if name == "FTHSDPStrategy":  # ft_hsdp's replication is torchft's, across jobs: no replicate_degree
        assert "--trainer.strategy.replicate_degree" not in text and "replicate_degree" not in options
    for option, default in options.items():
        found = re.search(rf"--trainer\.strategy\.{option} .*?\(type: (.*?), default: (.*?)\)", text)
        assert found, option
        assert found.group(1), option
        assert found.group(2) == ("null" if default is None else str(default)), (option, found.groups())


def test_fit_help_lists_the_strategy_and_callback_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "fit", "--help")
    for option in ("--trainer.strategy", "--trainer.callbacks", "--trainer.precision", "--model.dim",
                   "--data.batch_size"):
        assert option in text, option


# every flag of ``fsdp-strategies-ft`` with its default, as the hand-written parser had them before the
# options were declared once (LaunchOptions): none may go missing or change its default
FT_FLAGS: dict[str, Any] = {
    "--groups": 2, "--ranks-per-group": 1, "--runner": "torchrun", "--min-replicas": 1, "--bind": "127.0.0.1",
    "--lighthouse-port": 0, "--join-timeout-ms": 1000, "--quorum-tick-ms": 100,
    "--heartbeat-timeout-ms": 2000,
    "--kill-every": None, "--first-kill-after": None, "--kill-at-steps": None, "--max-restarts": 10,
    "--restart-delay": 0.0, "--events-dir": "outputs/ft_events", "--log-dir": None, "--seed": 0,
    "--timeout": None, "--grace": 30.0, "--pin-cores": "none", "--warm-spares": False,
}


def test_ft_launcher_help_lists_every_flag_with_its_help_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fsdp_strategies.ft.launch.launcher import main
    from fsdp_strategies.ft.launch.options import LaunchOptions

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    flags = {
        f"--{f.name.replace('_', '-')}": f for f in dataclasses.fields(LaunchOptions) if "help" in f.metadata
    }
    assert set(flags) == set(FT_FLAGS)
    for flag, default in FT_FLAGS.items():
        assert flags[flag].default == default, flag
        described = re.sub(r"\s+", " ", flags[flag].metadata["help"])
        assert described and f"{described} (default: {default})" in text, flag
        assert re.search(rf"\[{re.escape(flag)}[ \]]", text), flag  # in the usage line


def test_ft_launcher_flags_reach_the_options_and_the_command_is_what_follows() -> None:
    from fsdp_strategies.ft.launch.options import LaunchOptions, parse_args

    options, command = parse_args(["--", "train.py", "fit", "--trainer.max_steps", "3"])
    assert options == LaunchOptions() and command == ["train.py", "fit", "--trainer.max_steps", "3"]
    cpu = min(os.sched_getaffinity(0))
    pin = f"{cpu};{cpu};{cpu}"
    options, command = parse_args([
        "--groups", "3", "--ranks-per-group", "2", "--runner", "lightning", "--min-replicas", "2", "--bind",
        "0.0.0.0", "--lighthouse-port", "29510", "--join-timeout-ms", "500", "--quorum-tick-ms", "50",
        "--heartbeat-timeout-ms",
        "900", "--kill-every", "7.5", "--first-kill-after", "2", "--kill-at-steps", "1@8,20",
        "--max-restarts", "4",
        "--restart-delay", "0.5", "--events-dir", "ev", "--log-dir", "logs", "--seed", "3", "--timeout", "60",
        "--grace", "12", "--pin-cores", pin, "--warm-spares", "train.py", "fit"])
    assert command == ["train.py", "fit"]
    assert options == LaunchOptions(
        groups=3, ranks_per_group=2, runner="lightning", min_replicas=2, bind="0.0.0.0",
        lighthouse_port=29510,
        join_timeout_ms=500, quorum_tick_ms=50, heartbeat_timeout_ms=900, kill_every=7.5,
        first_kill_after=2.0,
        kill_at_steps="1@8,20", max_restarts=4, restart_delay=0.5, events_dir="ev", log_dir="logs", seed=3,
        timeout=60.0, grace=12.0, pin_cores=pin, warm_spares=True)
