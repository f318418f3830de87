"""Everything the docs call tested is registered in tests/guarantees.py, and every registered test runs in CI.

Three checks (see tests/guarantees.py for the registry and what counts as a claim):

(a) every claim line of README.md and docs/**/*.md lies inside the ``claim`` phrase of a registered guarantee
    for that doc (or of a :class:`~guarantees.NotAClaim`), and every registered phrase is still in its doc;
(b) every registered test id is collected and selected by CI: not skipped by a mark that holds when
    ``FSDP_STRATEGIES_FULL`` is unset, not ``soak`` (the long variants only ``FSDP_STRATEGIES_FULL=1``
    runs), and a ``tests/slurm`` id carries the ``slurm`` marker and is picked by the ``SLURM_SELECT`` that
    ``.ci/run`` passes to ``make test-slurm``. The markers are read from one ``pytest --collect-only`` run
    with a tiny plugin (``tests/check_guarantees.py``) that evaluates each item's skip marks and the ``-k``
    expression;
(c) a test file a claim names is among the files of that claim's test ids.

Each check is a function fed by the real docs / collection here and by made-up input in the ``*_can_fail``
tests. Whether the registered tests *passed* in a CI run is ``tests/check_guarantees.py``'s job (junit XML).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from check_guarantees import instances, not_passed, outcomes
from guarantees import GUARANTEES, NOT_CLAIMS, ROOT, TEST_FILE, Guarantee, Item, NotAClaim, doc_files, items
from support import processes

#: markers whose tests CI does not run (the lead's ``soak``: the long FSDP_STRATEGIES_FULL-only variants)
NOT_IN_CI = {"soak"}


def _phrase_spans(item: Item, phrase: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(re.escape(phrase), item.text)]


def unregistered(doc_items: Iterable[Item], guarantees: Iterable[Guarantee] = GUARANTEES,
                 not_claims: Iterable[NotAClaim] = NOT_CLAIMS) -> list[str]:
    """Check (a): each claim line of each item must overlap a registered phrase of its doc; 'doc:line: text'
    each."""
    phrases: dict[str, list[str]] = {}
    for entry in [*guarantees, *not_claims]:
        phrases.setdefault(entry.doc, []).append(
            entry.claim if isinstance(entry, Guarantee) else entry.phrase
        )
    problems = []
    for item in doc_items:
        covered: set[int] = set()
        for phrase in phrases.get(item.doc, []):
            for start, end in _phrase_spans(item, phrase):
                covered.update(line for line, s, e in item.spans if s <= end and start <= e)
        for line in sorted(item.claim_lines - covered):
            text = next(item.text[s:e] for ln, s, e in item.spans if ln == line)
            problems.append(f"{item.doc}:{line}: {text.strip()}")
    return problems


def stale(doc_texts: Mapping[str, list[Item]], guarantees: Iterable[Guarantee] = GUARANTEES,
          not_claims: Iterable[NotAClaim] = NOT_CLAIMS) -> list[str]:
    """Registered phrases no claim item of their doc holds any more (a doc edited, the registry not)."""
    problems = []
    for entry in [*guarantees, *not_claims]:
        phrase = entry.claim if isinstance(entry, Guarantee) else entry.phrase
        if not any(phrase in item.text for item in doc_texts.get(entry.doc, [])):
            problems.append(f"{entry.doc}: no claim holds {phrase!r} any more")
    return problems


def files_not_covered(doc_items: Iterable[Item], guarantees: Iterable[Guarantee] = GUARANTEES) -> list[str]:
    """Check (c): a test file named in an item must be among the files of the ids of the guarantees it
    holds."""
    problems = []
    for item in doc_items:
        matched = [g for g in guarantees if g.doc == item.doc and g.claim in item.text]
        if not matched:
            continue  # (a) reports it
        files = {test.split("::")[0] for g in matched for test in g.tests}
        for m in TEST_FILE.finditer(item.text):
            named = m.group(1)
            if not any(f == named or f.endswith("/" + named) for f in files):
                problems.append(
                    f"{item.doc}:{item.line_of(m.start())}: names {named}, but its registered tests are in "
                    f"{sorted(files)}"
                )
    return problems


def not_run_by_ci(test_ids: Iterable[str], collected: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Check (b) on what the collection plugin recorded per node id: markers, skip reason, ``-k`` match.

    A registered id without ``[...]`` that is not itself collected stands for all its parametrizations."""
    problems = []
    for test in sorted(
        {case for registered in test_ids for case in instances(registered, collected) or [registered]}
    ):
        info = collected.get(test)
        if info is None:
            problems.append(f"{test}: not collected (renamed or removed?)")
            continue
        marks = set(info["markers"])
        if info.get("skip"):
            problems.append(f"{test}: skipped when FSDP_STRATEGIES_FULL is unset ({info['skip']})")
        if marks & NOT_IN_CI:
            problems.append(f"{test}: marked {sorted(marks & NOT_IN_CI)}, which CI does not run")
        if test.startswith("tests/slurm/"):
            if "slurm" not in marks:
                problems.append(f"{test}: not marked slurm (`make test-slurm` runs -m slurm)")
            if not info.get("slurm_select"):
                problems.append(f"{test}: not picked by .ci/run's SLURM_SELECT")
    return problems


def slurm_select(ci_run: str) -> str:
    """The ``-k`` expression ``.ci/run`` hands to ``make test-slurm`` ('' when it runs all of tests/slurm)."""
    found = re.findall(r"make test-slurm(?:\s+SLURM_SELECT=(\"[^\"]*\"|'[^']*'|\S+))?", ci_run)
    if not found:
        raise AssertionError(".ci/run does not run `make test-slurm`: no tests/slurm id can count as CI-run")
    return found[-1].strip("\"'")


def collect(test_ids: Iterable[str], select: str) -> dict[str, dict[str, Any]]:
    """One ``pytest --collect-only`` of the registered ids' files, FSDP_STRATEGIES_FULL unset: the plugin's
    record."""
    files = sorted({test.split("::")[0] for test in test_ids})
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"guarantees-collect-{os.getpid()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FSDP_STRATEGIES_FULL", "PYTEST_CURRENT_TEST",
                                                            "PYTEST_ADDOPTS")}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]),
                "GUARANTEES_OUT": str(out), "GUARANTEES_SLURM_SELECT": select})
    proc = processes.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "check_guarantees", *files], timeout=240, env=env, cwd=str(ROOT))
    try:
        if proc.returncode != 0 or not out.exists():
            pytest.fail(
                f"collection failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ the real
# docs
def _doc_items() -> dict[str, list[Item]]:
    return {
        str(path.relative_to(ROOT)): items(path.read_text(), str(path.relative_to(ROOT)))
        for path in doc_files()
    }


def test_every_claim_in_the_docs_is_registered() -> None:
    problems = unregistered(item for found in _doc_items().values() for item in found)
    assert not problems, (
        "the docs call these tested, but tests/guarantees.py registers no claim on the line. Fix: "
        "add a Guarantee(doc, claim=<a phrase of that line>, tests=<the ids that check it>) -- or "
        "reword the line if no test checks it:\n" + "\n".join(problems)
    )


def test_no_registered_phrase_is_stale() -> None:
    problems = stale(_doc_items())
    assert not problems, "update tests/guarantees.py to the doc's new wording:\n" + "\n".join(problems)


def test_a_test_file_a_claim_names_is_among_its_tests() -> None:
    problems = files_not_covered(item for found in _doc_items().values() for item in found)
    assert not problems, "\n".join(problems)


def test_every_guarantee_names_tests_and_each_id_once() -> None:
    for g in GUARANTEES:
        assert g.tests, f"{g.doc}: {g.claim!r} names no test"
        assert len(set(g.tests)) == len(g.tests), f"{g.doc}: {g.claim!r} names a test twice"


@pytest.mark.subprocess
def test_every_registered_test_is_collected_and_selected_by_ci() -> None:
    ids = {test for g in GUARANTEES for test in g.tests}
    select = slurm_select((ROOT / ".ci" / "run").read_text())
    problems = not_run_by_ci(ids, collect(ids, select))
    assert not problems, ("registered in tests/guarantees.py but not run by CI (a doc calls them tested):\n"
                          + "\n".join(problems))


# ------------------------------------------------------------------------------------------------ each check
# can fail
FAKE_DOC = """# Page

Intro paragraph, nothing claimed.

The save is atomic (tested by killing a
run mid-save), and the export works.

- resume is exact (`tests/test_checkpoint.py`);
- not claimed here, but a list item a claim introduced:

```
make test  # the tests in a code block are not claims
```

## How it is tested

Two agents play two nodes.
"""


def test_the_scanner_finds_each_kind_of_claim() -> None:
    found = {item.line: item for item in items(FAKE_DOC, "docs/x.md")}
    assert sorted(found) == [5, 8, 17]  # "tested", a test file, an item of the "How it is tested" section
    assert found[5].claim_lines == {5} and found[5].text.endswith("and the export works.")
    listed = items("Checked by a test:\n\n- one\n- two\n\nAfter the list.\n", "d.md")
    # a list that a claim introduces with ":" is claimed too
    assert [item.line for item in listed] == [1, 3, 4]
    assert not items(
        "Not tested: DiLoCo with TP. A test helper makes a rank slow; the test cluster.\n", "d.md"
    )


def test_unregistered_can_fail() -> None:
    doc = items(FAKE_DOC, "docs/x.md")
    everything = [Guarantee("docs/x.md", "(tested by killing a", ("tests/t.py::a",)),
                  Guarantee("docs/x.md", "resume is exact", ("tests/test_checkpoint.py::b",)),
                  NotAClaim("docs/x.md", "Two agents play", "a fake")]
    assert unregistered(doc, everything, ()) == []
    assert unregistered(doc, everything[1:], ()) == ["docs/x.md:5: The save is atomic (tested by killing a"]
    # a phrase of another doc, or one that is not on the claim line, does not cover it
    assert unregistered(doc, [Guarantee("docs/y.md", "(tested by killing a", ("t",)), *everything[1:]], ())
    assert unregistered(doc, [Guarantee("docs/x.md", "and the export works", ("t",)), *everything[1:]], ())
    assert stale({"docs/x.md": doc}, [Guarantee("docs/x.md", "a phrase that is gone", ("t",))], ()) == [
        "docs/x.md: no claim holds 'a phrase that is gone' any more"]


def test_files_not_covered_can_fail() -> None:
    doc = items(FAKE_DOC, "docs/x.md")
    right = Guarantee("docs/x.md", "resume is exact", ("tests/test_checkpoint.py::test_resume",))
    wrong = Guarantee("docs/x.md", "resume is exact", ("tests/test_resume.py::test_mid_epoch",))
    assert files_not_covered(doc, [right]) == []
    assert files_not_covered(doc, [wrong]) == [
        "docs/x.md:8: names tests/test_checkpoint.py, but "
        "its registered tests are in ['tests/test_resume.py']"
    ]


def test_not_run_by_ci_can_fail() -> None:
    plain = {"markers": ["multiprocess"], "skip": None, "slurm_select": False}
    collected = {
        "tests/test_a.py::ok": plain,
        "tests/test_a.py::full": {**plain, "markers": ["full", "multiprocess"]},  # its own CI stage: counts
        "tests/test_a.py::skipped": {**plain, "skip": "full set only (FSDP_STRATEGIES_FULL=1)"},
        "tests/test_a.py::chaos": {**plain, "markers": ["soak", "multiprocess"]},
        "tests/slurm/test_s.py::picked": {"markers": ["slurm"], "skip": None, "slurm_select": True},
        "tests/slurm/test_s.py::left_out": {"markers": ["slurm"], "skip": None, "slurm_select": False},
        "tests/slurm/test_s.py::unmarked": {"markers": [], "skip": None, "slurm_select": True},
        "tests/test_b.py::cases[one]": plain,
        "tests/test_b.py::cases[two]": {**plain, "markers": ["soak"]},
    }
    assert not_run_by_ci(["tests/test_a.py::ok", "tests/test_a.py::full", "tests/slurm/test_s.py::picked"],
                         collected) == []
    assert not_run_by_ci(["tests/test_a.py::gone", *[k for k in collected if k.split("::")[1] in (
        "skipped", "chaos", "left_out", "unmarked")]], collected) == [
        "tests/slurm/test_s.py::left_out: not picked by .ci/run's SLURM_SELECT",
        "tests/slurm/test_s.py::unmarked: not marked slurm (`make test-slurm` runs -m slurm)",
        "tests/test_a.py::chaos: marked ['soak'], which CI does not run",
        "tests/test_a.py::gone: not collected (renamed or removed?)",
        "tests/test_a.py::skipped: skipped when FSDP_STRATEGIES_FULL "
        "is unset (full set only (FSDP_STRATEGIES_FULL=1))"]
    # a function id stands for each of its parametrizations: one that CI does not run fails it
    assert not_run_by_ci(["tests/test_b.py::cases[one]"], collected) == []
    assert not_run_by_ci(["tests/test_b.py::cases"], collected) == [
        "tests/test_b.py::cases[two]: marked ['soak'], which CI does not run"]
    assert instances("tests/test_b.py::case", collected) == []  # a prefix of the name is not the function


def test_slurm_select_is_read_from_the_ci_script() -> None:
    assert slurm_select('make test\nmake test-slurm SLURM_SELECT="hsdp_sbatch or scancel_signal_term"\n') == \
        "hsdp_sbatch or scancel_signal_term"
    assert slurm_select("make test-slurm\n") == ""
    with pytest.raises(AssertionError, match="does not run `make test-slurm`"):
        slurm_select("make test\n")


#: the shape of pytest's --junitxml output (xunit2): classname is the module's dotted path, name the test's
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="0" failures="1" skipped="1" tests="4"><testcase classname="tests.test_layout"
name="test_no_import_cycles" time="0.1" />
<testcase classname="tests.test_real_models" name="test_two_rank_cell[hf_llama-fsdp2-none-32-true]"
time="9" />
<testcase classname="tests.test_real_models" name="test_two_rank_cell[hf_t5-fsdp2-none-32-true]"
time="9"><failure
message="AssertionError">...</failure></testcase><testcase classname="tests.docs.test_site"
name="test_gpu_page_states_what_was_measured" time="0"><skipped type="pytest.skip"
message="no site">...</skipped></testcase>
<testcase classname="tests.test_x.TestGroup" name="test_in_a_class" time="0" /></testsuite></testsuites>"""


def test_junit_outcomes_and_not_passed_can_fail(tmp_path: Path) -> None:
    (tmp_path / "a.xml").write_text(JUNIT)
    results = outcomes([tmp_path / "a.xml"])
    assert results == {"tests/test_layout.py::test_no_import_cycles": "passed",
                       "tests/test_real_models.py::test_two_rank_cell[hf_llama-fsdp2-none-32-true]": "passed",
                       "tests/test_real_models.py::test_two_rank_cell[hf_t5-fsdp2-none-32-true]": "failed",
                       "tests/docs/test_site.py::test_gpu_page_states_what_was_measured": "skipped",
                       "tests/test_x.py::TestGroup::test_in_a_class": "passed"}
    # a pass in another stage's file does not hide a failure in this one
    (tmp_path / "b.xml").write_text(JUNIT.replace('<failure\nmessage="AssertionError">...</failure>', ""))
    assert (
        outcomes([tmp_path / "b.xml"])[
            "tests/test_real_models.py::test_two_rank_cell[hf_t5-fsdp2-none-32-true]"
        ]
        == "passed"
    )
    assert outcomes([tmp_path / "b.xml", tmp_path / "a.xml"])[
        "tests/test_real_models.py::test_two_rank_cell[hf_t5-fsdp2-none-32-true]"] == "failed"
    problems = not_passed(results)
    layout = [p for p in problems if p.startswith("tests/test_layout.py::")]
    # passed; its siblings were not run
    assert layout and not any("test_no_import_cycles" in p for p in layout)
    assert any(p.startswith("tests/test_real_models.py::test_two_rank_cell[hf_t5-fsdp2-none-32-true]: "
                            "failed -- backs")
               for p in problems)  # a function id: one failed parametrization fails it
    assert not any("hf_llama-fsdp2-none-32-true" in p for p in problems)
    assert any(
        p.startswith("tests/test_processes.py::") and ": not run -- backs docs/testing.md" in p
        for p in problems
    )
    everything = {case: "passed" for g in GUARANTEES for case in g.tests}
    assert not_passed(everything) == []
    assert len(not_passed({**everything, GUARANTEES[0].tests[0]: "skipped"})) == 1
