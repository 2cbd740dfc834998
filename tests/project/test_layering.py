"""The package's layers import only to their left: protocol <- core <- server / worker_client /
reduction / spmd <- cli. Each case imports every module of one layer in a fresh interpreter and
lists the modules of forbidden layers that came with them."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CASES = {
    # layer: the packages it must not load
    "paramserver.protocol": ("server", "worker_client", "reduction", "spmd", "cli", "core"),
    "paramserver.core": ("server", "worker_client", "reduction", "spmd", "cli"),
    "paramserver.worker_client": ("server", "reduction", "spmd", "cli"),
    "paramserver.server": ("worker_client", "spmd", "cli"),
    "paramserver.spmd": ("worker_client", "cli"),
    "paramserver.reduction": ("cli", "spmd"),
}

SCRIPT = """
import importlib, pkgutil, sys
layer, forbidden = sys.argv[1], sys.argv[2].split(",")
package = importlib.import_module(layer)
for info in pkgutil.walk_packages(package.__path__, layer + "."):
    importlib.import_module(info.name)
bad = sorted(m for m in sys.modules if any(m.startswith(f"paramserver.{f}") for f in forbidden))
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("layer", sorted(CASES))
def test_layer_imports_only_to_its_left(layer: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, layer, ",".join(CASES[layer])],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 0, f"{layer} loads {run.stdout.split()} ({run.stderr[-2000:]})"


def test_no_module_name_repeats_across_packages() -> None:
    """A module's name says what it holds: no two modules share a basename."""
    from pathlib import Path

    import paramserver

    root = Path(paramserver.__file__).parent
    seen: dict[str, list[str]] = {}
    for path in root.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py") or "api" in path.relative_to(root).parts:
            continue
        seen.setdefault(path.stem, []).append(str(path.relative_to(root)))
    for path in root.rglob("__init__.py"):  # a package's name counts too
        if path.parent != root and "api" not in path.relative_to(root).parts:
            seen.setdefault(path.parent.name, []).append(str(path.parent.relative_to(root)) + "/")
    repeated = {name: places for name, places in seen.items() if len(places) > 1}
    assert repeated == {}
