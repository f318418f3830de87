"""Bad option values and names through ``examples/train_llama.py`` (LightningCLI): parse-time errors, no
training.

The first line of the error names the option, the bad value, the valid values (or options) and a fix,
instead of jsonargparse's list of union members it tried. The launcher ``fsdp-strategies-ft`` does the same
for its flags, before it starts anything.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_python
from fsdp_strategies.cli import explain_error

CONFIGS = ROOT / "configs"


def _yaml(tmp_path: Path, config: str, old: str, new: str) -> str:
    text = (CONFIGS / config).read_text()
    assert old in text, (config, old)
    path = tmp_path / f"bad_{config}"
    path.write_text(text.replace(old, new, 1))
    return str(path)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert lines, stderr[-3000:]
    return lines[-1]


@pytest.mark.subprocess
def test_literal_on_a_strategy_through_the_script(tmp_path: Path) -> None:
    """The real command line: exit status 2 and the explanation first (YAML comm_hook misspelled)."""
    config = _yaml(tmp_path, "ddp_hooks_powersgd.yaml", "comm_hook: powersgd", "comm_hook: powersdg")
    proc = run_python(["examples/train_llama.py", "fit", "--config", config, "--print_config"], check=False,
                      timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    assert line.startswith(
        "error: trainer.strategy (fsdp_strategies.DDPHooksStrategy): comm_hook='powersdg' is not "
        "a valid value; valid values: 'allreduce', 'bf16_compress', 'fp16_compress', 'powersgd', "
        "'post_local_sgd', 'hierarchical_sgd'. Fix: did you mean comm_hook: powersgd?"
    ), line
    assert "Parser key" in proc.stderr  # jsonargparse's own message follows


@pytest.mark.parametrize(("make_args", "expected"), ids=[
    "strategy-literal-cli", "callback-literal-yaml", "callback-literal-yaml-2",
    "callback-optional-literal-cli",
    "strategy-option-typo-yaml", "callback-option-typo-cli", "trainer-option-typo-cli",
    "trainer-option-typo-yaml", "registry-name-with-options"], argvalues=[
    # Literal on a strategy, from the command line
    (lambda tmp: ["--trainer.strategy=fsdp_strategies.DDPHooksStrategy", "--trainer.strategy.comm_hook",
                  "topk"],
     r"trainer\.strategy \(fsdp_strategies\.DDPHooksStrategy\): "
     r"comm_hook='topk' is not a valid value; valid values: "
     r"'allreduce', .*'hierarchical_sgd'\. Fix: set comm_hook to one of them\."),
    # Literal on a callback, in YAML and on the command line
    (lambda tmp: ["--config", _yaml(tmp, "sac_selective_op.yaml", "mode: selective_op", "mode: selectiv_op")],
     r"trainer\.callbacks \(fsdp_strategies\.callbacks\.ActivationCheckpointing\): "
     r"mode='selectiv_op' is not a valid "
     r"value; valid values: 'full', 'selective_op', 'selective_layer', "
     r"'budget', 'none'\. Fix: did you mean mode: selective_op\?"),
    (lambda tmp: ["--config",
                  _yaml(tmp, "straggler.yaml", "  action: hierarchical_sgd ", "  action: evict_all ")],
     r"\(fsdp_strategies\.callbacks\.StragglerDetector\): "
     r"action='evict_all' is not a valid value; valid values: "
     r"'warn', 'hierarchical_sgd', 'semi_sync', 'evict', 'stop'\. Fix: did you mean action: evict\?"),
    (lambda tmp: ["--trainer.callbacks+=fsdp_strategies.MFUMonitor", "--trainer.callbacks.peak_dtype",
                  "bf61"],
     r"\(fsdp_strategies\.MFUMonitor\): peak_dtype='bf61' "
     r"is not a valid value; valid values: 'bf16', 'fp16', "
     r"'tf32', 'fp8', 'fp32' or null\. Fix: did you mean peak_dtype: bf16\?"),
    # misspelled option names: of a class_path strategy / callback, and of the Trainer itself
    (lambda tmp: ["--config", _yaml(tmp, "ddp_hooks_powersgd.yaml", "powersgd_rank:", "powersgd_rnak:")],
     r"trainer\.strategy \(fsdp_strategies\.DDPHooksStrategy\) "
     r"has no option 'powersgd_rnak'\. Fix: did you mean "
     r"'powersgd_rank'\? Its options: comm_hook, powersgd_rank, .*bucket_cap_mb, .*process_group_backend"),
    (lambda tmp: ["--trainer.callbacks+=fsdp_strategies.ActivationCheckpointing", "--trainer.callbacks.mod",
                  "full"],
     r"\(fsdp_strategies\.ActivationCheckpointing\) has no option 'mod'\. Fix: did you mean 'mode'\?"),
    (lambda tmp: ["--trainer.max_stepz", "5"],
     r"no option --trainer\.max_stepz\. Fix: did you mean --trainer\.max_steps\?"),
    (lambda tmp: ["--config", _yaml(tmp, "fsdp2.yaml", "max_steps:", "max_stepz:")],
     r"trainer has no option 'max_stepz'\. Fix: did you mean 'max_steps'\?"),
    # a registry name cannot take options: say to use the class path
    (lambda tmp: ["--trainer.strategy", "ddp_hooks", "--trainer.strategy.comm_hook", "powersgd"],
     r"the registered name 'ddp_hooks' takes no options\. Fix: name the class instead, --trainer\.strategy "
     r"fsdp_strategies\.DDPHooksStrategy"),
])
def test_bad_values_and_names_are_explained(make_args, expected: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import train_llama

    with pytest.raises(SystemExit) as info:
        train_llama.main(["fit", *make_args(tmp_path), "--print_config"])
    assert info.value.code == 2
    line = _error_line(capsys.readouterr().err)
    assert re.match(r"error: .*" + expected, line), line


def test_valid_config_and_other_errors_are_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    import train_llama

    with pytest.raises(SystemExit) as info:
        train_llama.main(["fit", "--config", str(CONFIGS / "ddp_hooks_powersgd.yaml"), "--print_config"])
    assert info.value.code == 0 and "comm_hook: powersgd" in capsys.readouterr().out
    assert (
        explain_error("Parser key \"trainer.max_steps\":\n  Expected a <class 'int'>. Got value: x") is None
    )


@pytest.mark.parametrize(("argv", "expected"), [
    (["--groups", "0", "--", "train.py"],
     r"--groups 0: a job needs at least one replica group\. Fix: a value >= 1\."),
    (["--min-replicas", "3", "--", "train.py"],
     r"--min-replicas 3 with --groups 2: the lighthouse would "
     r"wait forever .*Fix: --min-replicas between 1 and 2\."),
    (["--kill-at-steps", "1@x", "--", "train.py"],
     r"--kill-at-steps '1@x': '1@x' is not \[GROUP@\]STEP\. Fix: "),
    (["--kill-at-steps", "2@5", "--", "train.py"],
     r"--kill-at-steps '2@5': group 2 is out of range \[0, 1\]\. Fix: "),
    (["--kill-every", "0", "--", "train.py"], r"--kill-every 0\.0: must be positive\. Fix: "),
    (["--grace", "-1", "--", "train.py"],
     r"--grace -1\.0: a duration cannot be negative\. Fix: a value >= 0\."),
    (["--lighthouse-port", "70000", "--", "train.py"], r"--lighthouse-port 70000: not a TCP port\. Fix: "),
    (["--pin-cores", "0;x", "--", "train.py"], r"--pin-cores '0;x': 'x' is not a CPU list\. Fix: "),
    (["--runner", "forkserver", "--warm-spares", "--", "train.py"],
     r"--runner forkserver with --warm-spares: pick one .*Fix: drop --warm-spares"),
    (["--groups", "2"], r"no training command\. Fix: give the training script"),
])
def test_bad_launcher_options_are_refused_before_anything_starts(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fsdp-strategies-ft``: argparse's usage error (status 2) naming the flag, its value and a fix; no
    lighthouse, no group, not even the events directory."""
    from fsdp_strategies.ft.launch.launcher import main

    events = tmp_path / "events"
    with pytest.raises(SystemExit) as info:
        main(["--events-dir", str(events), *argv])
    assert info.value.code == 2
    line = _error_line(capsys.readouterr().err.replace("fsdp-strategies-ft: error: ", "error: "))
    assert re.match(r"error: " + expected, line), line
    assert not events.exists()


def test_launcher_options_from_python_are_checked_too() -> None:
    from fsdp_strategies.ft.launch.options import LaunchOptionError, LaunchOptions

    with pytest.raises(LaunchOptionError, match=r"--groups '2': not an integer\. Fix: give an integer\."):
        LaunchOptions(groups="2").validate(["train.py"])  # type: ignore[arg-type]
    with pytest.raises(LaunchOptionError, match=r"--warm-spares 1: not true or false\. Fix"):
        LaunchOptions(warm_spares=1).validate(["train.py"])  # type: ignore[arg-type]
    LaunchOptions(events_dir=Path("events"), timeout=5).validate(["train.py"])  # a path, an int for a float


# ------------------------------------------------------------------ bad values refused by the classes
# themselves (OptionError from a strategy's or callback's own checks, not jsonargparse's type checks): one
# `error:` line with the class, the option, the value and the fix -- no traceback -- while LightningCLI
# instantiates the classes.
GC, AC = "--trainer.callbacks+=fsdp_strategies.callbacks.GarbageCollection", \
    "--trainer.callbacks+=fsdp_strategies.callbacks.ActivationCheckpointing"


@pytest.mark.parametrize(("args", "expected"), ids=[
    "gc-every-0", "budget-above-1", "budget-negative", "budget-mode-without-budget", "tp-degree-0",
    "pretrained-missing"], argvalues=[
    ([GC, "--trainer.callbacks.every_n_steps", "0"],
     r"GarbageCollection: every_n_steps=0 is invalid\. Fix: an integer >= 1\."),
    ([AC, "--trainer.callbacks.mode", "budget", "--trainer.callbacks.memory_budget", "1.5"],
     r"ActivationCheckpointing: memory_budget=1\.5 is above 1\. Fix: "),
    ([AC, "--trainer.callbacks.mode", "budget", "--trainer.callbacks.memory_budget", "-0.1"],
     r"ActivationCheckpointing: memory_budget=-0\.1 is invalid\. Fix: "),
    ([AC, "--trainer.callbacks.mode", "budget"],
     r"ActivationCheckpointing: mode='budget' needs memory_budget\. Fix: "),
    (["--config", str(CONFIGS / "fsdp2_tp.yaml"), "--trainer.strategy.init_args.tensor_parallel_degree", "0"],
     r"FSDP2Strategy: tensor_parallel_degree=0 is invalid\. "
     r"Fix: 1 \(no tensor parallelism\) or the number of ranks"),
    (["--config", str(CONFIGS / "fsdp2_tp.yaml"), "--trainer.strategy.init_args.pretrained",
      "/does/not/exist"],
     r"FSDP2Strategy: pretrained='/does/not/exist' is not a "
     r"local folder\. Fix: pass the folder `save_pretrained` "
     r"wrote"),
])
def test_bad_values_refused_by_the_classes_are_one_line(args: list[str], expected: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import train_llama

    # the parser installs its own: restored after the test
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.chdir(tmp_path)  # nothing is written, but if it were, not into the repository
    with pytest.raises(SystemExit) as info:
        train_llama.main(["fit", "--config", str(CONFIGS / "fsdp2.yaml"), *args, "--trainer.max_steps", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    line = _error_line(err)
    assert re.fullmatch(r"error: " + expected + r".*", line), line
    assert "Traceback" not in err and "jsonargparse" not in err, err[-3000:]
    assert len([x for x in err.splitlines() if x.strip()]) <= 3, err  # usage, tip, the error line


def test_option_errors_from_python_lead_with_the_message() -> None:
    """From Python the exception is a ValueError (OptionError) whose message leads with option, value and fix;
    :func:`option_error_line` adds the class that raised it."""
    from fsdp_strategies import FSDP2Strategy
    from fsdp_strategies._options import OptionError
    from fsdp_strategies.callbacks import GarbageCollection
    from fsdp_strategies.cli import option_error_line

    for make, expected in ((lambda: GarbageCollection(every_n_steps=0),
                            "GarbageCollection: every_n_steps=0 is "),
                           (lambda: FSDP2Strategy(tensor_parallel_degree=0),  # type: ignore[arg-type]
                            "FSDP2Strategy: tensor_parallel_degree=0")):
        with pytest.raises(OptionError) as info:
            make()
        assert isinstance(info.value, ValueError) and "Fix: " in str(info.value)
        line = option_error_line(info.value)
        assert line is not None and line.startswith(expected) and "\n" not in line, line
    assert option_error_line(RuntimeError("not an option")) is None


@pytest.mark.multiprocess
def test_an_option_error_raised_on_the_ranks_is_one_line(tmp_path: Path) -> None:
    """A ``tp_plan`` glob that matches no module is found on the ranks (after the process group exists): the
    run still ends with one ``error:`` line naming the strategy, the glob and the fix, without a traceback."""
    bad = tmp_path / "bad_plan.yaml"
    bad.write_text("trainer:\n  strategy:\n    init_args:\n      tp_plan:\n"
                   "        model.layers.*.attention.wq: colwise\n        model.nothing.*: rowwise\n")
    proc = run_python(["examples/train_llama.py", "fit", "--config", str(CONFIGS / "fsdp2_tp.yaml"),
                       "--config", str(bad), "--trainer.devices", "2", "--trainer.max_steps", "1",
                       "--trainer.default_root_dir", str(tmp_path)], check=False, timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert errors and errors[0].startswith(
        "error: FSDP2Strategy: tp_plan: ['model.nothing.*'] match no module of the model"
    ), proc.stderr[-4000:]
    assert "Fix: write the globs against the LightningModule's module names" in errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # a degree that does not divide the devices: found when the Trainer sets up, before the ranks start
    proc = run_python(["examples/train_llama.py", "fit", "--config", str(CONFIGS / "fsdp2_tp.yaml"),
                       "--trainer.devices", "2", "--trainer.strategy.init_args.tensor_parallel_degree", "3",
                       "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path)], check=False,
                      timeout=300)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode == 1 and errors == [
        "error: FSDP2Strategy: tensor_parallel_degree=3 does "
        "not divide the 2 devices per node (world size 2): a "
        "tensor-parallel group must sit inside one node, where "
        "its per-layer collectives run on the fast links. "
        "Fix: choose tensor_parallel_degree from [1, 2]."
    ], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
