"""LightningCLI errors that lead with the option, the bad value and the valid values.

A bad ``comm_hook``, ``mode``, ``action`` or ``peak_dtype`` (options typed ``Literal``), or a
misspelled option of a class given by ``class_path``, reaches jsonargparse inside a union (a
strategy is ``str | Strategy``, callbacks ``list[Callback] | Callback | None``). Its error then
lists every union member it tried ("Not a valid subclass of Callback", the base class's own
attempt, ...) and the one useful line sits a few levels deep. :class:`ArgumentParser` keeps
jsonargparse's message but puts a one-line explanation first, with a fix (the closest valid value
or option name), built from that message and from the named class's signature.

A bad option *value* that a strategy or callback refuses itself
(:class:`~fsdp_strategies._options.OptionError`: ``memory_budget: 1.5``, ``every_n_steps: 0``, a
``tensor_parallel_degree`` that does not divide the devices, a ``tp_plan`` glob that matches nothing) is
reported the same way, as one ``error: Class: option=value ... Fix: ...`` line: raised while LightningCLI
instantiates the classes, with the usage line and exit status 2; raised later on a rank, with exit status 1
(the parser installs a ``sys.excepthook`` for that exception type only). ``FSDP_STRATEGIES_TRACEBACK=1`` shows
the full traceback instead.

Use it with any LightningCLI::

    LightningCLI(MyModel, MyData, parser_class=fsdp_strategies.cli.ArgumentParser)
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import os
import sys
import types
import weakref
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from fsdp_strategies._lightning_seam import JsonargparseMessage as MESSAGE
from fsdp_strategies._lightning_seam import subcommand_parser
from fsdp_strategies._options import is_option_error

__all__ = ["ArgumentParser", "explain_error", "option_error_line"]

_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_BASES = ("lightning.Callback", "lightning.pytorch.Callback", "lightning.pytorch.callbacks.Callback",
          "lightning.pytorch.callbacks.callback.Callback", "lightning.pytorch.strategies.Strategy",
          "lightning.pytorch.strategies.strategy.Strategy")


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _init_options(cls: Any) -> list[str]:
    """``__init__`` parameter names as jsonargparse resolves them (``**kwargs`` into the parents, minus the
    parameters a subclass passes itself); a plain walk of the MRO if jsonargparse cannot say."""
    try:
        from jsonargparse import ArgumentParser as _Parser

        parser = _Parser(exit_on_error=False)
        parser.add_class_arguments(cls, "init")
        keys = [k.split(".")[1] for k in parser.get_defaults().keys() if k.startswith("init.")]  # noqa: SIM118 (a Namespace: dotted keys)
        return list(dict.fromkeys(keys))
    except Exception:  # fewer or rougher suggestions, nothing worse
        pass
    names: list[str] = []
    for klass in getattr(cls, "__mro__", ()):
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            params = list(inspect.signature(init).parameters.values())[1:]
        except (TypeError, ValueError):
            break
        names += [
            p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in names
        ]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _closest(word: str, choices: list[str]) -> str | None:
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return found[0] if found else None


def _literal_values(text: str) -> list[str]:
    try:
        values = ast.literal_eval(f"({text},)")
    except (SyntaxError, ValueError):
        return [text]
    return [str(v) for v in values]


def _unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


def _class_findings(lines: list[str], where: str) -> list[str]:
    """One sentence per user-given class whose option or value was refused."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = MESSAGE.CLASS_PATH.match(lines[i])
        if not match:
            i += 1
            continue
        indent, class_path = len(match.group(1)), match.group(2)
        block = []
        i += 1
        while i < len(lines) and (len(lines[i]) - len(lines[i].lstrip())) > indent:
            block.append(lines[i])
            i += 1
        cls = _import(class_path)
        if class_path in _BASES or cls is None:
            continue  # jsonargparse's attempt with the union's base class: not what the user wrote
        name = f"{where} ({class_path})" if where else class_path
        key = None
        for j, line in enumerate(block):
            if m := MESSAGE.PARSER_KEY.match(line):
                key = m.group(1)
            elif (m := MESSAGE.LITERAL_GOT.search(line)) and key:
                out.append(_bad_value(name, key, _unquote(m.group(2)), _literal_values(m.group(1))))
                key = None
            elif (m := MESSAGE.LITERAL_IN_UNION.search(line)) and key:
                given = next((g.group(1) for g in map(MESSAGE.GIVEN.match, block[j:]) if g), "?")
                out.append(_bad_value(name, key, _unquote(given), _literal_values(m.group(1)), optional=True))
                key = None
            elif m := MESSAGE.NOT_ACCEPTED.search(line):
                out.append(_bad_option(name, m.group(1), _init_options(cls)))
    return out


def _bad_value(name: str, key: str, value: str, valid: list[str], optional: bool = False) -> str:
    closest = _closest(value, valid)
    shown = ", ".join(repr(v) for v in valid) + (" or null" if optional else "")
    fix = f"did you mean {key}: {closest}?" if closest else f"set {key} to one of them."
    return f"{name}: {key}={value!r} is not a valid value; valid values: {shown}. Fix: {fix}"


def _bad_option(name: str, option: str, options: list[str]) -> str:
    closest = _closest(option, options)
    fix = f"did you mean {closest!r}?" if closest else "use one of its options."
    listed = f" Its options: {', '.join(options)}." if options else ""
    return f"{name} has no option {option!r}. Fix: {fix}{listed}"


def _parser_keys(parser: Any) -> list[str]:
    """Every dotted option key of ``parser`` and of the subcommand parsers made with it (prefixes dropped)."""
    keys: list[str] = []
    for each in [parser, *ArgumentParser.made]:
        try:
            names = list(each.get_defaults().keys())  # a jsonargparse Namespace: dotted keys
            keys += [k for k in names if k not in keys]
        except Exception:  # a parser that cannot build its defaults: fewer suggestions, nothing worse
            continue
    return [k.split(".", 1)[1] if k.split(".", 1)[0] in _SUBCOMMANDS and "." in k else k for k in keys]


def _strategy_name_with_options(name: str) -> str | None:
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        entry = StrategyRegistry[name] if name in StrategyRegistry else None  # noqa: SIM401 (.get instantiates)
    except Exception:
        return None
    if not entry:
        return None
    cls = entry["strategy"]
    import fsdp_strategies

    # the top-level path (what configs/ use) when the class is exported there
    path = (f"fsdp_strategies.{cls.__qualname__}" if getattr(fsdp_strategies, cls.__qualname__, None) is cls
            else f"{cls.__module__}.{cls.__qualname__}")
    return (f"trainer.strategy: the registered name {name!r} takes no options. Fix: name the class instead, "
            f"--trainer.strategy {path} (or class_path: {path} with init_args in YAML).")


def explain_error(message: str, parser: Any = None) -> str | None:
    """A short explanation (with ``Fix:``) of a jsonargparse error message, or ``None`` if it has none."""
    lines = message.splitlines()
    first = MESSAGE.PARSER_KEY.match(lines[0]) if lines else None
    where = first.group(1) if first else ""
    found = _class_findings(lines, where)
    if not found and where == "trainer.strategy" and (m := MESSAGE.DOT_PATH.search(message)):
        hint = _strategy_name_with_options(m.group(1))
        found = [hint] if hint else []
    if not found and (m := MESSAGE.GROUP_OPTION.search(message)):
        group, option = m.groups()
        keys = [k.split(".")[-1] for k in _parser_keys(parser) if k.rsplit(".", 1)[0] == group]
        closest = _closest(option, keys)
        found = [
            f"{group} has no option {option!r}. Fix: "
            + (f"did you mean {closest!r}?" if closest else f"see --help for the options of {group}.")
        ]
    if not found and (m := MESSAGE.UNRECOGNIZED.search(lines[0] if lines else "")):
        keys = _parser_keys(parser)
        for arg in m.group(1).split():
            if not arg.startswith("--"):
                continue
            option = arg[2:].split("=", 1)[0]
            closest = _closest(option, keys)
            found.append(f"no option --{option}. Fix: " + (f"did you mean --{closest}?" if closest
                                                             else "see --help for the options."))
    if not found:
        return None
    return "\n".join(found)


def _option_error(exc: BaseException | None) -> BaseException | None:
    """The option error (:func:`~fsdp_strategies._options.is_option_error`) in ``exc``'s chain (jsonargparse
    re-raises what an ``__init__`` raised)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if is_option_error(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _owner(tb: types.TracebackType | None) -> str | None:
    """The class whose ``__init__`` (or method) raised: the last frame of the traceback with a ``self`` that
    is one of this package's strategies or callbacks."""
    owner = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and type(obj).__module__.startswith("fsdp_strategies."):
            owner = type(obj).__name__
        tb = tb.tb_next
    return owner


def option_error_line(exc: BaseException) -> str | None:
    """``Class: option=value is invalid. Fix: ...`` -- one line -- when ``exc`` is (or wraps) an option error
    (:class:`~fsdp_strategies._options.OptionError`); ``None`` otherwise."""
    err = _option_error(exc)
    if err is None:
        return None
    return _led_by(" ".join(str(err).split()), _owner(err.__traceback__))


def _led_by(message: str, owner: str | None) -> str:
    """``message`` led by ``owner:`` (the class), unless it already names it first."""
    if owner and not message.startswith((f"{owner}:", f"{owner}(")):
        return f"{owner}: {message}"
    return message


def _union_option_error(exc: BaseException) -> str | None:
    """jsonargparse tries each member of a union (a strategy is ``str | Strategy``) and raises a new error
    that quotes each member's message, so the class's own exception is not in the chain: take the quoted
    message that has this package's ``Fix:`` (jsonargparse's own messages never do), and the class from
    ``class_path``."""
    members = (MESSAGE.UNION_MEMBER_ERROR.match(line) for line in str(exc).splitlines())
    found = [m.group(1).rstrip() for m in members if m and "Fix: " in m.group(1)]
    if not found:
        return None
    owner = MESSAGE.UNION_CLASS.search(str(exc))
    return _led_by(found[0], owner[1] if owner else None)


def _excepthook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    line = option_error_line(value) if os.environ.get("FSDP_STRATEGIES_TRACEBACK") != "1" else None
    if line is None:
        return _previous_excepthook(kind, value, tb)
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
    text = f"error: {line}{f' (rank {rank})' if rank not in (None, '0') else ''}\n"
    try:
        sys.stderr.flush()
    except Exception:  # a closed or replaced stream: the write below still reaches file descriptor 2
        pass
    os.write(2, text.encode(errors="replace"))  # then the interpreter exits as usual (status 1, atexit runs)


_previous_excepthook = sys.excepthook


class ArgumentParser(LightningArgumentParser):
    """LightningCLI's parser; its errors start with :func:`explain_error`'s summary when there is one, and an
    option error raised while the classes are instantiated, or later in the run, is one ``error:`` line."""

    made: weakref.WeakSet[ArgumentParser] = weakref.WeakSet()  # LightningCLI makes one per subcommand too

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ArgumentParser.made.add(self)
        if sys.excepthook is not _excepthook:
            global _previous_excepthook
            _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook

    def instantiate_classes(self, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().instantiate_classes(cfg, *args, **kwargs)
        except Exception as exc:
            line = option_error_line(exc) or _union_option_error(exc)
            if line is None or os.environ.get("FSDP_STRATEGIES_TRACEBACK") == "1":
                raise
            super(LightningArgumentParser, self).error(line)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        try:  # errors inside a subcommand (fit, ...) carry that subcommand's parser, which knows its options
            summary = explain_error(message, subcommand_parser(ex) or self)
        except Exception:  # explaining must never hide jsonargparse's own message
            summary = None
        if summary:
            details = "\n".join("  " + line for line in message.splitlines())
            message = f"{summary}\n(jsonargparse's message:)\n{details}"
        super().error(message, ex)
