"""Griffe extension used by the docs build: reads the package's docstrings as they are written.

The source docstrings use Sphinx roles (``:class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy```,
``:mod:`...```), which mkdocstrings does not resolve and the strict build refuses: a role naming a class
rendered on this site becomes a link to it (by its public path), one naming a module of the package or
something in it a link to that module's section of docs/modules.md (generated from the source tree, so a
moved module moves its section; a stale name fails the strict build), anything else inline code.

Nothing is added: the descriptions stay those of the one declaration in the source. Defaults and types are
shown as values, not as the names the source spells them with: a default that is not a literal
(``DEFAULT_PREEMPT_GRACE_S``, ``default_pg_timeout``, ``1 << 20``) is replaced by the repr of the imported
class's real default, and a type that hides its allowed values behind an alias (``AsyncCheckpointMode``,
``CommHook``) by the values of its ``Literal`` (``'off' | 'thread' | 'process'``).
"""

from __future__ import annotations

import ast
import html
import importlib
import inspect
import re
import types
import typing
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import griffe

#: Public names rendered on the site, by their last path component -> the identifier mkdocstrings gives them.
RENDERED = {
    "FSDP2Strategy": "fsdp_strategies.FSDP2Strategy",
    "HSDPStrategy": "fsdp_strategies.HSDPStrategy",
    "FTHSDPStrategy": "fsdp_strategies.FTHSDPStrategy",
    "DDPHooksStrategy": "fsdp_strategies.DDPHooksStrategy",
    "ActivationCheckpointing": "fsdp_strategies.callbacks.ActivationCheckpointing",
    "MFUMonitor": "fsdp_strategies.callbacks.MFUMonitor",
    "StragglerDetector": "fsdp_strategies.callbacks.StragglerDetector",
}

_ROLE = re.compile(r":(?:py:)?(?:class|mod|meth|func|data|attr|obj|exc):`(~?)([^`]+)`")


_PACKAGE = Path(__file__).resolve().parents[2] / "src"
#: every module of the package (docs/modules.md renders each one's docstring under its dotted name)
_MODULES = {
    ".".join(p.relative_to(_PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for p in (_PACKAGE / "fsdp_strategies").rglob("*.py")
}


def _module_of(target: str) -> str | None:
    """The package module ``target`` (a module, or an object in one) lives in; None outside the package."""
    parts = target.split(".")
    prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
    return next((prefix for prefix in prefixes if prefix in _MODULES), None)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    last = target.rsplit(".", 1)[-1].removesuffix("()")
    shown = last if short else target
    if last in RENDERED:
        return f"[`{shown}`][{RENDERED[last]}]"
    # a dotted name may break after its dots (not inside a word), so that a narrow table column can wrap it
    code = f"<code>{html.escape(shown).replace('.', '.<wbr>')}</code>"
    module = _module_of(target.removesuffix("()"))
    return f"[{code}][{module}]" if module else code


class PublicDocstrings(griffe.Extension):
    """Rewrites the roles of every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        doc = obj.docstring
        if doc is None:
            return
        doc.value = _ROLE.sub(_role, doc.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self.on_object(obj=pkg)  # the top-level package is not passed to on_object


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _value_text(value: Any) -> str:
    if isinstance(value, timedelta):
        return f"timedelta(seconds={value.total_seconds():g})"
    return repr(value)


def _type_text(hint: Any) -> str:
    """A runtime type hint written out with its Literal values (aliases expanded)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if hint is type(None):
        return "None"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_text(a) for a in args)}]" if args else name
    return getattr(hint, "__name__", str(hint))


def _classes(obj: griffe.Object) -> Iterator[griffe.Class]:
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_module:
            yield from _classes(member)  # type: ignore[arg-type]
        elif member.is_class:
            yield member  # type: ignore[misc]


def _runtime_init(cls: griffe.Class) -> Any:
    try:
        return getattr(importlib.import_module(cls.module.path), cls.name).__init__
    except Exception:  # not importable here (an optional dependency): leave its source text
        return None


def show_values(cls: griffe.Class) -> None:
    """Defaults and alias types of ``cls.__init__``'s parameters as values (see the module docstring)."""
    init = cls.members.get("__init__")
    runtime = _runtime_init(cls)
    if init is None or init.is_alias or runtime is None:
        return
    try:
        signature = inspect.signature(runtime)
        hints = typing.get_type_hints(runtime)
    except Exception:
        return
    for param in init.parameters:  # type: ignore[union-attr]
        real = signature.parameters.get(param.name)
        if real is None:
            continue
        if param.default is not None and real.default is not inspect.Parameter.empty \
                and not _is_literal(str(param.default)):
            param.default = _value_text(real.default)
        hint = hints.get(param.name)
        if hint is not None and "Literal" in repr(hint) and "Literal" not in str(param.annotation):
            param.annotation = _type_text(hint)


class RealValues(griffe.Extension):
    """Applies :func:`show_values` to every class of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            show_values(cls)
