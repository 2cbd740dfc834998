"""Without an optional extra installed, its integration says which package is missing, as a
``ModuleNotFoundError`` naming it (so code that skips a missing extra, like the docs check,
recognises it), and the docs check still passes. Each case runs in a fresh interpreter with
the extra's package blocked (``sys.modules[name] = None``, as when it is not installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.parametrize(
    ("blocked", "module", "attr", "words"),
    [
        ("torch", "paramserver.integrations.torch", "", "needs PyTorch"),
        ("ray", "paramserver.integrations.ray", "RayShardGroup", "needs Ray"),
    ],
)
def test_a_missing_extra_is_a_module_not_found_error_naming_it(
    blocked: str, module: str, attr: str, words: str
) -> None:
    code = (
        "import importlib, sys\n"
        f"sys.modules[{blocked!r}] = None\n"
        "try:\n"
        f"    m = importlib.import_module({module!r})\n"
        f"    getattr(m, {attr!r}) if {attr!r} else None\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc.name, str(exc), sep='|')\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    kind, name, message = out.stdout.strip().split("|", 2)
    assert kind == "ModuleNotFoundError"
    assert name == blocked
    assert words in message and f"paramserver[{blocked}]" in message


def test_the_docs_check_passes_without_torch_and_ray() -> None:
    # The README's test command on a machine with only the demo and dev extras: the docs pages
    # name paramserver.integrations.torch, which cannot be imported there.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['ray'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:randomly',"
        " 'tests/project/test_docs_links.py']))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
