"""The built documentation site, opened in headless Chromium (run by ``make docs`` after
``mkdocs build --strict``).

Not collected by ``make test`` (its pytest line passes ``--ignore=tests/docs``): it needs the built ``site/``
and a Chromium. A missing site or browser is a failure, never a skip.

Each strategy and callback page must render a parameters table that lists every option of the class, read
with ``inspect.signature`` (nothing here names an option). A class whose ``__init__`` takes ``**kwargs``
passes them on to its parent, so the page must also list the parent's options, except those the class
fixes itself in its ``super().__init__(...)`` call (``FTHSDPStrategy`` sets ``replicate_degree=1``).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import textwrap
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import fsdp_strategies
from fsdp_strategies import callbacks
from support import processes

# each check reads a built page through one headless Chromium process
pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site"
RESULTS = ROOT / "benchmarks" / "results"

#: page (under site/) -> the class whose options it documents
PAGES = {
    "strategies/fsdp2": fsdp_strategies.FSDP2Strategy,
    "strategies/hsdp": fsdp_strategies.HSDPStrategy,
    "strategies/ft_hsdp": fsdp_strategies.FTHSDPStrategy,
    "strategies/ddp_hooks": fsdp_strategies.DDPHooksStrategy,
    "callbacks/activation_checkpointing": callbacks.ActivationCheckpointing,
    "callbacks/garbage_collection": callbacks.GarbageCollection,
    "callbacks/mfu_monitor": callbacks.MFUMonitor,
    "callbacks/straggler_detector": callbacks.StragglerDetector,
}


def _chromium() -> str:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    pytest.fail("no Chromium found (chromium / chromium-browser / google-chrome, or $CHROMIUM): "
                "`make docs` installs the Debian package `chromium` when it is missing")


def dump_dom(page: str) -> str:
    """The page's DOM after Chromium has loaded it (scripts run), as HTML."""
    path = SITE / page / "index.html"
    assert path.is_file(), f"{path} is missing: build the site first (`make docs` runs mkdocs build --strict)"
    proc = processes.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--virtual-time-budget=3000", "--dump-dom", path.as_uri()],
        timeout=120,
    )
    assert proc.returncode == 0 and "<html" in proc.stdout, (
        f"chromium failed on {page}: {proc.stderr[-2000:]}"
    )
    return proc.stdout


class _Tables(HTMLParser):
    """Collects the rows of every table introduced by a ``Parameters:`` section title (mkdocstrings'
    tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict[str, Any]] = []  # {"head": [...], "names": [...], "rows": [[cell, ...], ...]}
        self._title = False
        self._pending = False
        self._table: dict[str, Any] | None = None
        self._row: list[str] = []
        self._cell: str | None = None  # "th" | "td"
        self._col = -1
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "span" and "doc-section-title" in classes:
            self._title, self._text = True, ""
        elif tag == "table" and self._pending:
            self._table, self._pending = {"head": [], "names": [], "rows": []}, False
        elif self._table is not None and tag == "tr":
            self._col, self._row = -1, []
        elif self._table is not None and tag in ("th", "td"):
            self._cell, self._text = tag, ""
            self._col += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "span" and self._title:
            self._title = False
            self._pending = self._text.strip() == "Parameters:"
        elif self._table is not None and tag == self._cell:
            if tag == "th":
                self._table["head"].append(self._text.strip())
            else:
                if self._col == 0:
                    self._table["names"].append(self._text.strip())
                self._row.append(" ".join(self._text.split()))
            self._cell = None
        elif self._table is not None and tag == "tr" and self._row:
            self._table["rows"].append(self._row)
        elif tag == "table" and self._table is not None:
            self.tables.append(self._table)
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._title or self._cell:
            self._text += data


def parameter_tables(html: str) -> list[dict[str, Any]]:
    parser = _Tables()
    parser.feed(html)
    return parser.tables


def _fixed_by_super_call(cls: type) -> set[str]:
    """Keyword arguments ``cls.__init__`` passes to ``super().__init__`` itself (not options of ``cls``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    fixed: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__init__"
            and isinstance(node.func.value, ast.Call)
            and getattr(node.func.value.func, "id", None) == "super"
        ):
            fixed |= {kw.arg for kw in node.keywords if kw.arg is not None}
    return fixed


def options(cls: type) -> set[str]:
    """Every option a user can pass to ``cls``: its own ``__init__`` parameters, plus (through ``**kwargs``)
    the parent's options that ``cls`` does not fix itself, up the package's own classes."""
    params = inspect.signature(cls.__init__).parameters.values()
    names = {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        parent = next(b for b in cls.__mro__[1:] if "__init__" in vars(b))
        if parent.__module__.startswith("fsdp_strategies"):
            names |= options(parent) - _fixed_by_super_call(cls) - names
    return names


def test_option_discovery_follows_kwargs_into_the_parent() -> None:
    fsdp2 = options(fsdp_strategies.FSDP2Strategy)
    assert "block_class_names" in fsdp2 and "async_checkpoint" in fsdp2
    assert options(fsdp_strategies.HSDPStrategy) >= fsdp2 | {"replicate_degree", "shard_degree"}
    ft = options(fsdp_strategies.FTHSDPStrategy)
    assert ft >= fsdp2 | {"shard_degree", "lighthouse_addr"} and "replicate_degree" not in ft


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_renders_every_option_in_a_parameters_table(page: str) -> None:
    cls = PAGES[page]
    tables = parameter_tables(dump_dom(page))
    assert tables, f"{page}: no parameters table rendered for {cls.__name__}"
    for table in tables:
        assert table["head"][:3] == ["Name", "Type", "Description"], (page, table["head"])
    listed = {name for table in tables for name in table["names"]}
    missing = sorted(options(cls) - listed)
    assert not missing, f"{page}: options of {cls.__name__} missing from its parameters tables: {missing}"


def _type_aliases() -> set[str]:
    """Names the package gives to Literal types (``AsyncCheckpointMode = Literal[...]``)."""
    pattern = re.compile(r"^(\w+)(?::\s*TypeAlias)?\s*=\s*Literal\[", re.M)
    return {m.group(1) for path in (ROOT / "src").rglob("*.py") for m in pattern.finditer(path.read_text())}


def _is_value(text: str) -> bool:
    if text in ("required", "") or text.startswith("timedelta("):
        return True
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


@pytest.mark.parametrize("page", sorted(PAGES))
def test_option_tables_show_values_not_the_names_of_constants_or_aliases(page: str) -> None:
    # the Default column shows the real default (25.0, not DEFAULT_PREEMPT_GRACE_S; 1048576, not 1 << 20) and
    # the Type column the allowed values ('off' | 'thread' | 'process', not AsyncCheckpointMode): static HTML
    aliases = _type_aliases()
    assert {"AsyncCheckpointMode", "CommHook"} <= aliases, aliases
    tables = parameter_tables((SITE / page / "index.html").read_text())
    assert tables, page
    for table in tables:
        kind, default = table["head"].index("Type"), table["head"].index("Default")
        for row in table["rows"]:
            named = sorted(a for a in aliases if re.search(rf"\b{a}\b", row[kind]))
            assert not named, f"{page}: option {row[0]}: type shown as {row[kind]!r} (alias {named})"
            assert _is_value(row[default]), f"{page}: option {row[0]}: default shown as {row[default]!r}"


def test_performance_page_has_a_generated_section_and_figure_per_result_file() -> None:
    html = dump_dom("performance")
    files = [p for p in sorted(RESULTS.glob("*.json")) if isinstance(json.loads(p.read_text()), dict)]
    assert files
    for path in files:
        assert f'id="{path.stem}"' in html, f"performance page: no section for {path.name}"
        png = RESULTS / f"{path.stem}.png"
        if png.is_file():
            assert f"assets/benchmarks/{png.name}" in html, f"performance page: {png.name} not embedded"
            assert (SITE / "assets" / "benchmarks" / png.name).is_file()


def test_gpu_page_states_what_was_measured() -> None:
    text = dump_dom("gpu")
    gpu_files = [p for p in RESULTS.glob("*.json")
                 if isinstance(data := json.loads(p.read_text()), dict) and data.get("device",
                                                                                     "cpu") != "cpu"]
    if gpu_files:
        for path in gpu_files:
            assert f'id="{path.stem}"' in text
    else:
        assert "No GPU figures have been measured yet" in text


#: A page loaded into a 1400 px wide frame; once it has loaded, the frame's tables are measured and the result
#: written into this page as JSON (read from Chromium's --dump-dom; file:// frames are readable with
#: --allow-file-access-from-files).
_MEASURE = """<!doctype html><html><body><pre id="out">not loaded</pre>
<iframe id="frame" src="{src}" style="width:{width}px;height:900px;border:0"></iframe>
<script>
document.getElementById("frame").addEventListener("load", () => {{
  const doc = document.getElementById("frame").contentDocument;
  const cut = [], split = [];
  doc.querySelectorAll("article table").forEach((table, index) => {{
    const box = table.closest(".md-typeset__scrollwrap") || table.parentElement;
    const head = Array.from(table.querySelectorAll("th")).map(th => th.textContent.trim()).join(" | ");
    if (box.scrollWidth > box.clientWidth + 1)
      cut.push({{table: index, head: head, needs: box.scrollWidth, has: box.clientWidth}});
    table.querySelectorAll("td code").forEach(code => {{
      // a line break inside a code span between two word characters ("Strat|egy"); after a space, a dot or
      // a "|" it is a wrap
      const range = doc.createRange(), walker = doc.createTreeWalker(code, NodeFilter.SHOW_TEXT);
      let top = null, previous = "";
      for (let node = walker.nextNode(); node; node = walker.nextNode()) {{
        for (let i = 0; i < node.length; i++) {{
          range.setStart(node, i); range.setEnd(node, i + 1);
          const rect = range.getBoundingClientRect(), ch = node.data[i];
          if (top !== null && rect.top > top + 2 && /\\w/.test(previous) && /\\w/.test(ch))
            split.push({{table: index, code: code.textContent}});
          if (top === null || rect.top > top + 2) top = rect.top;
          previous = ch;
        }}
      }}
    }});
  }});
  document.getElementById("out").textContent = JSON.stringify({{cut: cut, split: split}});
}});
</script></body></html>"""


def measure_tables(page: str, tmp_path: Path, width: int = 1400) -> dict[str, list[dict[str, Any]]]:
    """Tables of ``page`` wider than the page's column at ``width`` px (``cut``: they scroll sideways) and
    one-word code names broken over two lines inside a table cell (``split``)."""
    path = SITE / page / "index.html"
    assert path.is_file(), f"{path} is missing: build the site first (`make docs` runs mkdocs build --strict)"
    wrapper = tmp_path / f"measure-{page.replace('/', '-') or 'index'}.html"
    wrapper.write_text(_MEASURE.format(src=path.as_uri(), width=width))
    proc = processes.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--allow-file-access-from-files", f"--window-size={width + 100},1000", "--virtual-time-budget=5000",
         "--dump-dom", wrapper.as_uri()],
        timeout=120,
    )
    match = re.search(r'<pre id="out">(.*?)</pre>', proc.stdout, re.S)
    assert match and match.group(1).startswith("{"), f"{page}: not measured ({proc.stderr[-2000:]})"
    return json.loads(match.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))


@pytest.mark.parametrize("page", ["", "strategies/fsdp2", "strategies/hsdp", "strategies/ft_hsdp",
                                  "real-models"])
def test_tables_fit_a_1400px_window_and_code_names_do_not_break_mid_word(page: str, tmp_path: Path) -> None:
    found = measure_tables(page, tmp_path)
    where = page or "home"
    assert not found["cut"], f"{where}: tables cut off at 1400 px (they scroll sideways): {found['cut']}"
    assert not found["split"], f"{where}: code names broken mid-word in tables: {found['split']}"


def _module_reference() -> Any:
    import importlib.util

    path = ROOT / "docs" / "hooks" / "module_reference.py"
    spec = importlib.util.spec_from_file_location("module_reference", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_modules_page_has_every_module_and_names_in_pages_link_to_it() -> None:
    hook = _module_reference()
    names = hook.module_names()
    assert {"fsdp_strategies", "fsdp_strategies.ft.protocol", "fsdp_strategies._torch_seam"} <= set(names)
    html = (SITE / "modules" / "index.html").read_text()
    missing = [name for name in names if f'id="{name}"' not in html]
    assert not missing, f"modules page: no section for {missing}"
    roles = re.findall(r":(?:func|class|mod|data|meth|attr|exc|obj):", html)
    assert not roles, f"modules page: Sphinx roles left unrendered: {roles[:5]}"
    # a name in a page links to its module's section, or to the class's own page
    ft_page = (SITE / "strategies" / "ft_hsdp" / "index.html").read_text()
    assert 'href="../../modules/#fsdp_strategies.ft.protocol"' in ft_page
    linked = hook.link_names("see `fsdp_strategies.ft.UNFIXABLE_EXIT_CODE` and "
                             "`fsdp_strategies.callbacks.MFUMonitor`\n```\n`fsdp_strategies.nothing`\n```\n",
                             "page.md")
    assert "[`fsdp_strategies.ft.UNFIXABLE_EXIT_CODE`][fsdp_strategies.ft]" in linked
    assert "[`fsdp_strategies.callbacks.MFUMonitor`][fsdp_strategies.callbacks.MFUMonitor]" in linked
    assert "`fsdp_strategies.nothing`" in linked  # code blocks are left alone


@pytest.mark.parametrize("name", ["fsdp_strategies.data_position", "fsdp_strategies.ft.no_such_module",
                                  "fsdp_strategies.callbacks.hang_watchdog.NO_SUCH_CODE"])
def test_a_page_naming_something_the_package_does_not_have_fails_the_build(name: str) -> None:
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match=re.escape(name)):
        _module_reference().link_names(f"the position (`{name}`) is recorded", "checkpoints.md")
