"""Option checks shared by every strategy and callback: one spelling of each rule and of its error.

Every check raises :class:`OptionError` (a ``ValueError``) with the shape
``<name>=<value> is invalid. Fix: <what to give>.``
at ``__init__`` time (before any process group exists). Allowed string values come from the
``Literal`` type of the parameter (:func:`choices`), so the values are written once, in the signature
that LightningCLI also reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, get_args

import torch

__all__ = ["DTYPE_NAMES", "OptionError", "check_bool", "check_choice", "check_degree", "check_dtype",
           "check_int", "check_number", "choices", "is_option_error", "listing"]

#: The dtype names options take (``param_dtype: bf16``, ``--dtype fp16``), the long and the short spelling.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class OptionError(ValueError):
    """A bad option value of a strategy or callback: the message names the option, the value and the fix.

    A ``ValueError``; :class:`fsdp_strategies.cli.ArgumentParser` reports it as one ``error:`` line instead of
    a traceback, wherever it is raised (while LightningCLI instantiates the classes, or later on a rank). An
    exception that must keep another type (a ``FileNotFoundError`` for a missing folder) counts as an option
    error when its class sets ``option_error = True`` (:func:`is_option_error`)."""

    option_error = True


def is_option_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a bad option value (:class:`OptionError` or a class with
    ``option_error = True``)."""
    return bool(getattr(type(exc), "option_error", False))


def choices(literal: Any) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` type (also through ``Optional``/``Union``), in order."""
    out: list[Any] = []
    for arg in get_args(literal):
        if arg is type(None):
            continue
        nested = get_args(arg)
        out += [v for v in nested if v not in out] if nested and not isinstance(arg, str) else [arg]
    return tuple(out)


def listing(names: Iterable[object], shown: int = 8, sep: str = ", ") -> str:
    """The first ``shown`` of ``names``, then how many more: an error names what is wrong (keys, files,
    styles) without printing all of a large model's thousand keys. One spelling for every such list."""
    items = [str(n) for n in names]
    more = f"{sep}... and {len(items) - shown} more" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


def _fail(name: str, value: Any, fix: str, prefix: str = "") -> OptionError:
    return OptionError(f"{prefix}{name}={value!r} is invalid. Fix: {fix}")


def check_int(name: str, value: Any, low: int = 0, high: int | None = None, *, optional: bool = False,
              fix: str | None = None, prefix: str = "") -> Any:
    """An ``int`` (not a ``bool``) in ``[low, high]``; ``None`` passes when ``optional``. Returns
    ``value``."""
    if value is None and optional:
        return value
    if isinstance(value, bool) or not isinstance(value,
                                                 int) or value < low or (high is not None and value > high):
        if fix is None:
            fix = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            fix += ", or leave it unset." if optional else "."
        raise _fail(name, value, fix, prefix)
    return value


def check_number(name: str, value: Any, *, positive: bool = True, optional: bool = False,
                 fix: str | None = None, prefix: str = "") -> Any:
    """A real number (not a ``bool``), ``> 0`` when ``positive`` (``>= 0`` otherwise). Returns ``value``."""
    if value is None and optional:
        return value
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or (value <= 0 if positive else value < 0):
        if fix is None:
            fix = "a positive number." if positive else "a number >= 0."
        raise _fail(name, value, fix, prefix)
    return value


def check_bool(name: str, value: Any, prefix: str = "") -> bool:
    """``True`` or ``False`` exactly (YAML ``yes`` arrives as a string and is refused)."""
    if not isinstance(value, bool):
        raise _fail(name, value, "true or false.", prefix)
    return value


def check_choice(name: str, value: Any, literal: Any, *, optional: bool = False, prefix: str = "") -> Any:
    """One of the values of the ``Literal`` type ``literal``; ``None`` passes when ``optional``."""
    allowed = choices(literal)
    if (value is None and optional) or value in allowed:
        return value
    raise _fail(name, value, f"one of {list(allowed)}{' or unset' if optional else ''}.", prefix)


def check_dtype(name: str, value: str | None, allowed: Iterable[str] = DTYPE_NAMES) -> torch.dtype | None:
    """The dtype a name in ``allowed`` (of :data:`DTYPE_NAMES`) stands for; ``None`` passes (the default)."""
    names = list(allowed)
    if value is None:
        return None
    if value not in names:
        raise OptionError(f"{name}={value!r} is not a dtype this option takes. Fix: use one of "
                          f"{sorted(names)}.")
    return DTYPE_NAMES[value]


def check_degree(name: str, value: Any, prefix: str = "") -> Any:
    """A mesh degree: a positive ``int``, ``"auto"`` or ``None``."""
    if value is None or value == "auto":
        return value
    return check_int(name, value, 1, fix="give a positive integer, or 'auto'.", prefix=prefix)
