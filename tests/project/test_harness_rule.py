"""Tests start long-lived processes only through the harness (``tests/harness``), whose
handles kill and reap what they started; see docs/testing.md "Process harness"."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: Files allowed to call ``Popen`` themselves, each for its stated reason.
EXEMPT = {
    "conformance/conftest.py": "the server under test may be another implementation's command",
    "project/test_leak_check.py": "it leaves an orphan on purpose, to see the check find it",
    "project/test_harness_rule.py": "it writes such lines as test data",
}
_POPEN = re.compile(r"\bPopen\(|\bmultiprocessing\b.*\bProcess\(|\bget_context\(")


def offenders(root: Path) -> list[str]:
    """``path:line`` of every process start outside the harness and the exempt files."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("harness/") or rel in EXEMPT:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _POPEN.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_processes_are_started_through_the_harness() -> None:
    assert offenders(TESTS) == []


def test_the_rule_finds_a_popen(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "test_x.py").write_text("p = subprocess.Popen(['true'])\n")
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "processes.py").write_text("p = subprocess.Popen(['true'])\n")
    assert offenders(tmp_path) == ["server/test_x.py:1: p = subprocess.Popen(['true'])"]
