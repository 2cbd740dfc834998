"""``benchmarks/embedding.py --quick`` runs, and every system it measures passes its
exactly-once check (final rows equal a numpy oracle of the same pushes). Speed is never
asserted here: the figures live in benchmarks/RESULTS.md."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.harness.processes import ScriptProcess

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ["numpy", "paramserver", "paramserver-fused", "paramserver-net", "paramserver-net-fused"]
if importlib.util.find_spec("torch") is not None:
    SYSTEMS.append("torch_rpc_fused")


@pytest.mark.timeout(240)
def test_quick_mode_verifies_every_system_exactly_once(tmp_path: Path) -> None:
    script = ScriptProcess(
        tmp_path,
        "bench-embedding",
        [str(ROOT / "benchmarks" / "embedding.py"), "--quick", "--no-memory",
         "--systems", ",".join(SYSTEMS)],
        group=True,
        cwd=ROOT,
    )  # fmt: skip
    try:
        out, err = script.communicate(timeout_s=200)
    finally:
        script.close()
    assert script.proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    measured = {line["system"]: line for line in lines if "rows_per_s" in line}
    assert sorted(measured) == sorted(SYSTEMS), (lines, err)
    for system, line in measured.items():
        assert line["verified"] is True, (system, line)
        assert line["rows_checked"] > 0, (system, line)
