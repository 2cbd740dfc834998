"""The user docs point at things that exist: every intra-doc link and anchor, every repository
path in backticks and every ``paramserver.x.y`` name of README.md, docs/*.md and
benchmarks/RESULTS.md resolves in this checkout (a module move that forgets a page fails here)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/RESULTS.md"]
_PATH = re.compile(
    r"`((?:paramserver|tests|benchmarks|scripts|deploy|monitoring|protos|docs)/[^`\s]*)`"
)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _resolves(name: str) -> bool:
    """``name`` is a module, or an attribute path under the longest importable module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("paramserver"):
                return True  # an optional extra (ray, torch) is not installed: not checkable
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except ModuleNotFoundError as exc:  # a lazy attribute of an extra (paramserver...ray)
            return bool(exc.name and not exc.name.startswith("paramserver"))
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_paths_and_names_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    bad: list[str] = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"link to a missing file: {target}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"link to a missing heading: {target}")
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".,")
        if not any(c in path for c in "<*{") and not (ROOT / path).exists():
            bad.append(f"missing path: {path}")
    for m in re.finditer(r"\bparamserver(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text):
        name = m.group(0)
        if name.split(".")[1] not in ("api", "json") and not _resolves(name):
            bad.append(f"unresolved name: {name}")
    assert bad == []


def test_readme_is_a_short_user_guide() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= 12 * 1024, f"README.md is {size} bytes; reference material goes under docs/"
