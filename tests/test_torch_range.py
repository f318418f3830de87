"""The supported torch / transformers / Python range equals the one ``make test-torch-range`` tests.

That target runs the fast tests plus the multi-process ones marked ``torch_range`` in two venvs: the floor
(``TORCH_FLOOR`` on ``TORCH_FLOOR_PYTHON`` with ``TRANSFORMERS_FLOOR``) and the newest (``TORCH_NEWEST`` on
``TORCH_NEWEST_PYTHON`` with the newest transformers pip resolves); ``tests/conftest.py`` stops a run that
imports another torch or transformers than the one asked for. The checks here hold the claims to those ends:
pyproject's lower bounds are the floors, ``requires-python`` admits exactly the Pythons tested, the README and
the supported- versions table name them, and the torch / transformers / Python running now are inside the
claims.
"""

from __future__ import annotations

import re
import sys

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import ROOT


def _make_var(name: str) -> str:
    found = re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile: {name} is not set"
    return found.group(1)


def _requirement_text(name: str) -> str:
    specs = re.findall(rf'"{name}\s*([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert specs and len(set(specs)) == 1, (
        f"pyproject.toml: {name} is required as {specs} (one range expected)"
    )
    return specs[0]


def _requirement(name: str) -> SpecifierSet:
    return SpecifierSet(_requirement_text(name))


def _lower_bound(spec: SpecifierSet) -> Version:
    lower = [Version(s.version) for s in spec if s.operator == ">="]
    assert len(lower) == 1, f"{spec}: one >= bound expected"
    return lower[0]


def _requires_python_text() -> str:
    found = re.search(r'^requires-python = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml: requires-python is not set"
    return found.group(1)


def _requires_python() -> SpecifierSet:
    return SpecifierSet(_requires_python_text())


def test_the_claimed_floors_are_the_tested_floors() -> None:
    torch_floor, transformers_floor = (
        Version(_make_var("TORCH_FLOOR")),
        Version(_make_var("TRANSFORMERS_FLOOR")),
    )
    assert _lower_bound(_requirement("torch")) == Version(f"{torch_floor.major}.{torch_floor.minor}")
    assert torch_floor.micro == 0, (
        "the floor run tests the first release of the minor series the claim starts at"
    )
    assert _lower_bound(_requirement("transformers")) == transformers_floor
    assert Version(_make_var("TORCH_NEWEST")) > torch_floor


def test_requires_python_admits_exactly_the_tested_pythons() -> None:
    tested = {_make_var("TORCH_FLOOR_PYTHON"), _make_var("TORCH_NEWEST_PYTHON")}
    assert all(re.fullmatch(r"python3\.\d+", p) for p in tested), tested
    minors = {int(p.split(".")[1]) for p in tested}
    spec = _requires_python()
    admitted = {m for m in range(6, 20) if Version(f"3.{m}.0") in spec and Version(f"3.{m}.99") in spec}
    assert admitted == set(range(min(minors), max(minors) + 1)) == minors, (str(spec), sorted(tested))


def test_readme_and_the_table_state_the_tested_ends() -> None:
    readme = (ROOT / "README.md").read_text()
    table = (ROOT / "docs" / "getting-started.md").read_text()
    for var in ("TORCH_FLOOR", "TORCH_NEWEST", "TRANSFORMERS_FLOOR"):
        value = _make_var(var)
        assert value in readme and value in table, f"{var}={value} is not stated in README.md and the table"
    for spec in (_requirement_text("torch"), _requirement_text("transformers"), _requires_python_text()):
        assert f"`{spec}`" in table, f"docs/getting-started.md's table does not state `{spec}`"


def test_this_run_is_inside_the_claims() -> None:
    import transformers

    assert Version(torch.__version__.split("+")[0]) in _requirement("torch"), torch.__version__
    assert Version(transformers.__version__) in _requirement("transformers"), transformers.__version__
    assert Version(".".join(map(str, sys.version_info[:3]))) in _requires_python(), sys.version
