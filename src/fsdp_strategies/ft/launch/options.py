"""The options of ``fsdp-strategies-ft``, declared once: the fields of :class:`LaunchOptions`.

Each command-line flag is a dataclass field whose metadata holds its help text (and, where useful, its
``metavar`` or ``choices``); :func:`build_parser` derives the argparse parser from those fields -- the
flag is the field name with dashes, its type comes from the annotation (``int``, ``float``, ``str``;
``X | None`` for "unset"; ``bool`` becomes a switch) and its default is the field's default. A field
without help text is an option of the Python API only (:func:`fsdp_strategies.ft.launch.launcher.run`):
``python`` and ``env``. Adding an option is adding a field; the parser, ``--help`` and the keyword
arguments of ``run()`` follow.

:meth:`LaunchOptions.validate` checks every value before anything starts (no lighthouse, no process)
and raises :class:`LaunchOptionError` naming the flag, the bad value and a ``Fix:``; on the command line
that becomes argparse's usage error (status 2). Two options carry their own small languages, parsed
here as well: ``--kill-at-steps`` (:func:`parse_kill_at`) and ``--pin-cores`` (:func:`core_sets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from fsdp_strategies.ft.timeouts import LighthouseTimeouts, check_lighthouse_timeouts

__all__ = ["RUNNERS", "LaunchOptionError", "LaunchOptions", "build_parser", "core_sets", "parse_args",
           "parse_kill_at"]

#: how a replica group's ranks are started (see ``--runner``)
RUNNERS = ("torchrun", "lightning", "forkserver")

DESCRIPTION = (
    "fsdp-strategies-ft: run fault-tolerant HSDP on this machine -- a lighthouse plus N replica groups."
)


class LaunchOptionError(SystemExit):
    """A bad launcher option: the message names the flag, its value and a ``Fix:``."""


def _help(text: str, *, metavar: str | None = None, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's metadata that makes it the command-line flag ``--name-with-dashes``."""
    return {"help": text, "metavar": metavar, "choices": choices}


@dataclass
class LaunchOptions:
    """The launcher's options: every field with help text is the flag ``--field-name`` (see
    :func:`build_parser`)."""

    groups: int = field(default=2, metadata=_help("number of replica groups"))
    ranks_per_group: int = field(default=1, metadata=_help("processes per replica group (torchrun nproc)"))
    runner: str = field(default="torchrun", metadata=_help(
        "start each group with torchrun, as `python SCRIPT` "
        "(Lightning's launcher), or 'forkserver': fork its ranks "
        "from one process that has already imported torch, "
        "Lightning and torchft (a restart skips the imports; the "
        "server costs memory, not CPU)", choices=RUNNERS))
    min_replicas: int = field(default=1, metadata=_help("lighthouse: fewest groups to form a quorum"))
    bind: str = field(default="127.0.0.1", metadata=_help("lighthouse bind host (loopback by default)"))
    lighthouse_port: int = field(default=0, metadata=_help("lighthouse port; 0 = any free port"))
    join_timeout_ms: int = field(default=1000, metadata=_help(
        "lighthouse: how long a quorum waits for more groups to join once --min-replicas are there"))
    quorum_tick_ms: int = field(
        default=100, metadata=_help("lighthouse: how often it checks whether a quorum can form")
    )
    heartbeat_timeout_ms: int = field(default=2000, metadata=_help(
        "a dead group counts as alive this long: the survivors' "
        "stall per fault (>= 200: groups heartbeat every "
        "100 ms; each group's quorum_timeout_s must cover it + --join-timeout-ms + --quorum-tick-ms)"))
    kill_every: float | None = field(default=None, metadata=_help(
        "SIGKILL a random live group (one that has committed "
        "a step since its start; never the last) every SECONDS",
        metavar="SECONDS"))
    kill_at_steps: str | None = field(default=None, metadata=_help(
        "SIGKILL group G (or round-robin) once it has committed STEP and another group is live",
        metavar="[G@]STEP,..."))
    first_kill_after: float | None = field(default=None, metadata=_help(
        "delay of the first --kill-every fault; None: one --kill-every period", metavar="SECONDS"))
    max_restarts: int = field(default=10, metadata=_help(
        "restarts per group before the launcher gives up on it (and the job fails)"))
    restart_delay: float = field(default=0.0, metadata=_help(
        "wait this long before restarting a group that exited", metavar="SECONDS"))
    events_dir: str | os.PathLike[str] = field(default="outputs/ft_events", metadata=_help(
        "per-group step logs + launcher.jsonl (emptied at start)"))
    log_dir: str | os.PathLike[str] | None = field(default=None, metadata=_help(
        "per-group stdout/stderr; None: --events-dir"))
    seed: int = field(default=0, metadata=_help("victim choice for --kill-every"))
    timeout: float | None = field(default=None, metadata=_help(
        "give up after this long: the Python stacks of every group still running go to its log, then exit "
        "status 124", metavar="SECONDS"))
    grace: float = field(default=30.0, metadata=_help(
        "on SIGTERM: how long the groups may take to stop (and checkpoint) before SIGKILL; more than the "
        "strategy's preempt_grace_s", metavar="SECONDS"))
    pin_cores: str = field(default="none", metadata=_help(
        "pin each replica group's processes to its own CPUs "
        "(os.sched_setaffinity; kept across restarts): 'auto' "
        "splits the allowed CPUs evenly, or one cpu-list per group, e.g. '0-3;4-7'",
        metavar="none|auto|CPUS;CPUS;..."))
    warm_spares: bool = field(default=False, metadata=_help(
        "keep a standby incarnation per replica group (started "
        "once the group has committed a step: Python, imports "
        "and Trainer built, then waiting without a process "
        "group or quorum seat); a failed group is replaced by it "
        "instead of a cold start. Costs one idle copy of the "
        "group's processes (their memory, no CPU); helps process "
        "failures, not the loss of the host the spare runs on"))
    #: the interpreter that runs each group (Python API only; ``--runner forkserver`` needs this one)
    python: str = sys.executable
    #: extra environment variables for every group (Python API only)
    env: dict[str, str] | None = None

    def validate(self, command: list[str]) -> None:
        """Check every option (and that there is a command) before anything starts; raise
        :class:`LaunchOptionError`."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if "help" in f.metadata:
                _check_type(f.name, getattr(self, f.name), hints[f.name])
        _at_least(self, "groups", 1, "a job needs at least one replica group")
        _at_least(self, "ranks_per_group", 1, "a replica group needs at least one process")
        if self.runner not in RUNNERS:
            raise LaunchOptionError(
                f"--runner {self.runner!r}: use one of {', '.join(RUNNERS)}. Fix: --runner "
                "torchrun (the default) unless a restart's import time matters (forkserver)"
            )
        if self.min_replicas < 1 or self.min_replicas > self.groups:
            why = "a quorum needs at least one group" if self.min_replicas < 1 else \
                "the lighthouse would wait forever for that many groups"
            raise LaunchOptionError(f"--min-replicas {self.min_replicas} with --groups {self.groups}: {why}. "
                                    f"Fix: --min-replicas between 1 and {self.groups}.")
        if not 0 <= self.lighthouse_port <= 65535:
            raise LaunchOptionError(
                f"--lighthouse-port {self.lighthouse_port}: not a TCP port. Fix: 0 (any free "
                "port) or a port in 1..65535."
            )
        for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
            _at_least(self, name, 1, "a duration in milliseconds must be positive")
        problem = check_lighthouse_timeouts(self.lighthouse_timeouts())
        if problem:
            raise LaunchOptionError(problem)
        for name in ("kill_every", "timeout"):
            if getattr(self, name) is not None:
                _positive(self, name)
        for name in ("first_kill_after", "restart_delay", "grace"):
            _at_least(self, name, 0, "a duration cannot be negative")
        _at_least(self, "max_restarts", 0, "a count cannot be negative")
        if self.runner == "forkserver" and self.warm_spares:
            raise LaunchOptionError(
                "--runner forkserver with --warm-spares: pick one "
                "(both shorten a restart; the forkserver already "
                "starts every incarnation with its imports done, at no CPU cost between faults). Fix: drop "
                "--warm-spares, or use --runner torchrun with it."
            )
        if self.runner == "forkserver" and os.path.realpath(self.python) != os.path.realpath(sys.executable):
            raise LaunchOptionError(f"--runner forkserver forks from this Python ({sys.executable}), not "
                                    f"{self.python!r}. Fix: run the launcher with that interpreter, or use "
                                    "--runner torchrun.")
        if not command:
            raise LaunchOptionError(
                "no training command. Fix: give the training script and its arguments after the "
                "options (e.g. -- examples/train_llama.py fit ...)"
            )
        parse_kill_at(self.kill_at_steps, self.groups)
        core_sets(self.pin_cores, self.groups)

    def lighthouse_timeouts(self) -> LighthouseTimeouts:
        """The lighthouse's three timeouts; ``.to_env()`` is what the groups' strategy checks its own against
        (:mod:`fsdp_strategies.ft.timeouts`)."""
        return LighthouseTimeouts(self.heartbeat_timeout_ms, self.join_timeout_ms, self.quorum_tick_ms)


def _check_type(name: str, value: Any, hint: Any) -> None:
    """``value`` fits the field's annotation: an ``int``, ``float`` (an int will do), ``str``/path or
    ``bool``."""
    allowed = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    if value is None and len(allowed) < len(typing.get_args(hint)):
        return
    for kind in allowed:
        origin = typing.get_origin(kind) or kind
        if kind is bool and isinstance(value, bool):
            return
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if kind is not bool and kind not in (int, float) and isinstance(value, origin):
            return
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    want = " or ".join(names.get(k, getattr(typing.get_origin(k) or k, "__name__", str(k))) for k in allowed)
    raise LaunchOptionError(f"--{name.replace('_', '-')} {value!r}: not {want}. Fix: give {want}.")


def _at_least(opts: LaunchOptions, name: str, low: float, why: str) -> None:
    value = getattr(opts, name)
    if value is not None and value < low:
        raise LaunchOptionError(f"--{name.replace('_', '-')} {value!r}: {why}. Fix: a value >= {low}.")


def _positive(opts: LaunchOptions, name: str) -> None:
    value = getattr(opts, name)
    if value <= 0:
        raise LaunchOptionError(
            f"--{name.replace('_', '-')} {value!r}: must be positive. Fix: a number of seconds "
            f"> 0, or leave --{name.replace('_', '-')} out."
        )


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _arg_type(hint: Any) -> type:
    """What argparse converts a flag's text to: the first of ``int``/``float`` in the annotation, else
    ``str``."""
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    return next((t for t in members if t in (int, float)), str)


def build_parser() -> argparse.ArgumentParser:
    """The ``fsdp-strategies-ft`` parser, one flag per :class:`LaunchOptions` field with help text."""
    parser = argparse.ArgumentParser(prog="fsdp-strategies-ft", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(LaunchOptions)
    for f in dataclasses.fields(LaunchOptions):
        if "help" not in f.metadata:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if hints[f.name] is bool:
            parser.add_argument(flag, action="store_true", default=f.default, help=f.metadata["help"])
            continue
        extra = {k: f.metadata[k] for k in ("metavar", "choices") if f.metadata.get(k) is not None}
        parser.add_argument(
            flag, type=_arg_type(hints[f.name]), default=f.default, help=f.metadata["help"], **extra
        )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] run by every replica group"
    )
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[LaunchOptions, list[str]]:
    """The command line -> checked options and the groups' command (a bad value is argparse's usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    options = LaunchOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchOptions)
                               if "help" in f.metadata})
    try:
        options.validate(command)
    except LaunchOptionError as err:
        parser.error(str(err))
    return options, command


def parse_kill_at(spec: str | None, groups: int) -> list[tuple[int | None, int]]:
    """``--kill-at-steps``: ``"8,20"`` (victim chosen round-robin) or ``"1@8,0@20"`` (group@committed step),
    as ``(group or None, step)`` sorted by step."""
    out: list[tuple[int | None, int]] = []
    fix = (
        "Fix: comma-separated committed steps, each optionally prefixed by a replica group id, e.g. '8,0@20'."
    )
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        g, _, s = item.rpartition("@")
        try:
            gid, step = (int(g) if g else None), int(s)
        except ValueError:
            raise LaunchOptionError(
                f"--kill-at-steps {spec!r}: {item!r} is not [GROUP@]STEP. {fix}"
            ) from None
        if gid is not None and not 0 <= gid < groups:
            raise LaunchOptionError(
                f"--kill-at-steps {spec!r}: group {gid} is out of range [0, {groups - 1}]. "
                f"Fix: a group id below --groups {groups}."
            )
        if step < 0:
            raise LaunchOptionError(f"--kill-at-steps {spec!r}: step {step} is negative. {fix}")
        out.append((gid, step))
    return sorted(out, key=lambda x: x[1])


def _parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the kernel's cpu-list syntax)."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(part)
        cpus.extend(range(first, last + 1))
    return cpus


def core_sets(spec: str, groups: int) -> list[list[int]] | None:
    """The CPUs of each replica group for ``--pin-cores`` (``None``: no pinning).

    Why pin: a replica group that trains alone after a peer died would otherwise also run on the dead
    group's cores, so goodput under faults would be measured against a machine the fault-free run
    shared. ``auto`` splits this process's allowed CPUs into ``groups`` equal contiguous blocks; an
    explicit value lists each group's CPUs, groups separated by ``;`` (``"0-3;4-7"``; a CPU may repeat).
    """
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "none":
        return None
    example = ";".join(str(allowed[i % len(allowed)]) for i in range(groups))
    if spec == "auto":
        per = len(allowed) // groups
        if per < 1:
            raise LaunchOptionError(
                f"--pin-cores auto: {groups} replica groups but "
                f"this process may use only {len(allowed)} CPUs "
                f"{allowed}. Fix: fewer --groups, or give each group its CPUs explicitly, e.g. --pin-cores "
                f"'{example}' (groups may share a CPU)."
            )
        return [allowed[i * per:(i + 1) * per] for i in range(groups)]
    fix = (
        f"Fix: 'none', 'auto', or {groups} CPU lists separated by ';' (e.g. '{example}'), using the allowed "
        f"CPUs {allowed}."
    )
    parts = spec.split(";")
    if len(parts) != groups:
        raise LaunchOptionError(
            f"--pin-cores {spec!r}: {len(parts)} CPU lists for {groups} replica groups. {fix}"
        )
    sets: list[list[int]] = []
    for part in parts:
        try:
            cpus = _parse_cpu_list(part)
        except ValueError:
            raise LaunchOptionError(f"--pin-cores {spec!r}: {part!r} is not a CPU list. {fix}") from None
        outside = sorted(set(cpus) - set(allowed))
        if outside:
            raise LaunchOptionError(
                f"--pin-cores {spec!r}: CPUs {outside} are not available to this process. {fix}"
            )
        sets.append(sorted(set(cpus)))
    return sets
