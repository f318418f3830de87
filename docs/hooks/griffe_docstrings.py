"""Griffe extension used by the docs build: reads the package's docstrings as they are written.

Two habits of the source docstrings would otherwise break the strict build or the option tables:

* one ``Args:`` entry for several options (``bucket_cap_mb / static_graph / ...: passed to DDP``):
  split into one entry per option (same description), so every option gets its own table row;
* Sphinx roles (``:class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy```, ``:mod:`...```): a role
  naming a class rendered on this site becomes a link to it (by its public path), anything else inline
  code (internal module paths move; the docs never link to them).

Nothing is added: the descriptions, types and defaults stay those of the one declaration in the source.
"""

from __future__ import annotations

import re
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
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Keyword Arguments):\s*$")
_JOINED = re.compile(r"^(\s+)(\w+(?:\s*/\s*\w+)+)(\s*\([^)]*\))?:\s*(.*)$")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    last = target.rsplit(".", 1)[-1].removesuffix("()")
    shown = last if short else target
    if last in RENDERED:
        return f"[`{shown}`][{RENDERED[last]}]"
    return f"`{shown}`"


def split_joined_entries(text: str) -> str:
    """``a / b: desc`` inside an ``Args:`` section -> ``a: desc`` and ``b: desc`` (continuation lines copied)."""
    lines = text.splitlines()
    out: list[str] = []
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        head = _SECTION.match(line)
        if head:
            section_indent = len(head.group(1))
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if section_indent is not None and line.strip() and indent <= section_indent:
            section_indent = None  # left the section
        joined = _JOINED.match(line) if section_indent is not None else None
        if not joined:
            out.append(line)
            i += 1
            continue
        entry_indent, names, annotation, first = joined.groups()
        block = [first]
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(entry_indent)):
            block.append(lines[i])
            i += 1
        for name in (n.strip() for n in names.split("/")):
            out.append(f"{entry_indent}{name}{annotation or ''}: {block[0]}")
            out.extend(block[1:])
    return "\n".join(out)


class PublicDocstrings(griffe.Extension):
    """Applies both rewrites to every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        doc = obj.docstring
        if doc is None:
            return
        doc.value = _ROLE.sub(_role, split_joined_entries(doc.value))
