"""Did every test the docs rely on pass in this CI run? ``python tests/check_guarantees.py JUNIT.xml...``

Reads the junit XML files pytest wrote (``--junitxml``; one per CI stage: ``make test``, ``make test-full``,
``make docs``, ``make test-slurm``) and exits 1 naming every test id registered in ``tests/guarantees.py``
that did not pass in any of them -- missing (not run), skipped, failed or errored -- with the doc claim it
backs. An id that passed in one file and failed in another counts as failed. Exit 0 prints how many were
checked.

The module is also the pytest plugin ``tests/test_guarantees.py`` loads (``-p check_guarantees``) into its one
``--collect-only`` run: for each collected item it records the marker names, the reason of a skip mark that
holds (pytest's own evaluation of ``skip``/``skipif``, conditions included) and whether the ``-k`` expression
in ``GUARANTEES_SLURM_SELECT`` picks it, as JSON into ``GUARANTEES_OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from guarantees import GUARANTEES


# ------------------------------------------------------------------------------------------------ junit
# results
def _node_id(case: ET.Element) -> str:
    """pytest's node id from a junit ``testcase``: classname ``tests.test_x`` (or ``tests.test_x.Class``) +
    name."""
    parts = case.get("classname", "").split(".")
    # the module is the last dotted part that is a test file; what follows are classes
    cut = max(
        (i for i, p in enumerate(parts) if p.startswith("test_") or p == "conftest"), default=len(parts) - 1
    )
    path = "/".join(parts[:cut + 1]) + ".py"
    return "::".join([path, *parts[cut + 1:], case.get("name", "")])


def outcomes(junit_files: Iterable[Path]) -> dict[str, str]:
    """node id -> ``passed`` / ``skipped`` / ``failed`` over all files (a failure anywhere wins, then a
    pass)."""
    rank = {"failed": 2, "passed": 1, "skipped": 0}
    result: dict[str, str] = {}
    for path in junit_files:
        for case in ET.parse(path).getroot().iter("testcase"):
            tags = {child.tag for child in case}
            outcome = (
                "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
            )
            node = _node_id(case)
            if node not in result or rank[outcome] > rank[result[node]]:
                result[node] = outcome
    return result


def instances(test: str, known: Iterable[str]) -> list[str]:
    """The concrete ids a registered id stands for: itself, or every parametrization of a function id
    (``f[...]``)."""
    known = list(known)
    if test in known:
        return [test]
    return [k for k in known if "[" not in test and k.startswith(test + "[")]


def not_passed(results: dict[str, str]) -> list[str]:
    """One line per registered id that did not pass (a function id: any of its parametrizations), with its
    claims."""
    claims: dict[str, list[str]] = {}
    for g in GUARANTEES:
        for test in g.tests:
            claims.setdefault(test, []).append(f"{g.doc}: {g.claim!r}")
    problems = []
    for test, backs in sorted(claims.items()):
        found = instances(test, results)
        bad = [f"{case}: {results[case]}" for case in found if results[case] != "passed"]
        if not found:
            bad = [f"{test}: not run"]
        problems += [f"{line} -- backs {'; '.join(backs)}" for line in bad]
    return problems


def main(argv: list[str]) -> int:
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: python tests/check_guarantees.py JUNIT.xml [JUNIT.xml ...]  (pytest --junitxml files)",
              file=sys.stderr)
        return 2
    missing = [a for a in argv if not Path(a).is_file()]
    if missing:
        print("check_guarantees: no such junit file: "
              f"{', '.join(missing)}. Fix: run pytest with --junitxml=FILE "
              "first.", file=sys.stderr)
        return 2
    problems = not_passed(outcomes(Path(a) for a in argv))
    total = len({test for g in GUARANTEES for test in g.tests})
    if problems:
        print(f"check_guarantees: of the {total} tests the docs call "
              "tested (tests/guarantees.py), these did not pass "
              f"in {', '.join(argv)}:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    print(f"check_guarantees: all {total} tests behind {len(GUARANTEES)} documented claims passed")
    return 0


# ------------------------------------------------------------------------------------------------ collection
# plugin
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    out = os.environ.get("GUARANTEES_OUT")
    if not out:
        return
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression
    from _pytest.skipping import evaluate_skip_marks

    select = os.environ.get("GUARANTEES_SLURM_SELECT", "")
    expression = Expression.compile(select) if select else None
    record = {}
    for item in items:
        skip = evaluate_skip_marks(item)
        record[item.nodeid] = {
            "markers": sorted({m.name for m in item.iter_markers()}),
            "skip": skip.reason if skip is not None else None,
            "slurm_select": expression is None or expression.evaluate(KeywordMatcher.from_item(item)),
        }
    Path(out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
