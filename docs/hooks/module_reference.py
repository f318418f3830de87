"""MkDocs hook: the package's modules on one page, and every name the pages spell out linked to its section.

Every module of ``src/fsdp_strategies`` starts with a docstring that says what it does, why, and its limits
(docs/architecture.md). A page asks for them with the line ``{{ modules }}`` (docs/modules.md): one
mkdocstrings block per module (its docstring only, members are documented where they are used), in the
order of the source tree, so a new or moved module appears without editing a page.

On every other page an inline code span that names something of the package
(`` `fsdp_strategies.ft.protocol` ``, `` `fsdp_strategies.ft.UNFIXABLE_EXIT_CODE` ``) becomes a link: to the
class's own page when the site renders it (the strategies and callbacks), else to the section of the module
that defines it. A span whose name imports nothing (a moved or misspelt module, an attribute that does not
exist) fails the build, naming the page and the name. Fenced code blocks and spans already inside a link are
left as they are.
"""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "fsdp_strategies"
MARKER = re.compile(r"^\{\{\s*modules\s*\}\}\s*$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
#: an inline code span naming the package, not already the text of a link ("[`...`]")
SPAN = re.compile(r"(?<![\[`])`(fsdp_strategies(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`(?!\]|`)")
DOCS = ROOT / "docs"
DIRECTIVE = re.compile(r"^::: (fsdp_strategies[\w.]*)\s*$", re.M)


def module_names() -> list[str]:
    """Every module and package of the source tree, packages before their modules (``__main__`` left out)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return sorted(names, key=lambda name: name.split("."))


def modules_page() -> str:
    blocks = []
    for name in module_names():
        blocks += [f"::: {name}", "    options:", "      show_root_full_path: true",
                   "      show_symbol_type_heading: true", "      heading_level: 2", ""]
    return "\n".join(blocks)


def _rendered() -> dict[int, str]:
    """id() of each object a page renders with a ``::: name`` block -> that block's identifier."""
    found = {}
    for page in sorted(DOCS.rglob("*.md")):
        for name in DIRECTIVE.findall(page.read_text()):
            module_name, _, attr = name.rpartition(".")
            try:
                found.setdefault(id(getattr(importlib.import_module(module_name), attr)), name)
            except (ImportError, AttributeError):
                continue  # a module block, or a name mkdocstrings itself will refuse
    return found


def target(name: str) -> str:
    """The autorefs identifier a mention of ``name`` links to; PluginError when it names nothing."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        home = module_name
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise PluginError(f"`{name}`: {'.'.join([home, attr])} does not exist")
            obj = getattr(obj, attr)
            if isinstance(obj, types.ModuleType):
                home = obj.__name__
        if isinstance(obj, types.ModuleType):
            return obj.__name__
        if id(obj) in RENDERED:
            return RENDERED[id(obj)]
        defined_in = getattr(obj, "__module__", None) if isinstance(obj, type | types.FunctionType) else None
        if isinstance(defined_in, str) and defined_in.startswith("fsdp_strategies"):
            return defined_in
        return home
    raise PluginError(f"`{name}`: no module of that name")


RENDERED = _rendered()


def link_names(markdown: str, page: str) -> str:
    def link(match: re.Match[str]) -> str:
        try:
            return f"[`{match.group(1)}`][{target(match.group(1))}]"
        except PluginError as err:
            raise PluginError(f"docs: {page}: {err} (a moved module or a misspelt name?)") from None

    out, pos = [], 0
    for fence in FENCE.finditer(markdown):
        out += [SPAN.sub(link, markdown[pos:fence.start()]), fence.group(0)]
        pos = fence.end()
    out.append(SPAN.sub(link, markdown[pos:]))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER.search(markdown):
        return MARKER.sub(lambda _: modules_page(), markdown)
    return link_names(markdown, page.file.src_uri)
