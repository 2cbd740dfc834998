"""Helpers of the fault-injection suite beside the harness's processes
(:mod:`tests.harness`): an independent checkpoint reader and a timing report."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

__all__ = ["report", "verify_checkpoint"]


def report(fault: str, **measured: Any) -> None:
    """Print one measurement line (``pytest -s`` shows them; docs/durability.md quotes them)."""
    values = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in measured.items()
    )
    print(f"\n[fault-timing] {fault}: {values}", flush=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Read a committed checkpoint independently of the product's reader: recompute every
    tensor's sha256 against the manifest (AssertionError on any mismatch). Returns
    ``{"tensors": name -> array of the manifest's shape, "manifest": dict}``."""
    manifest = json.loads((path / "manifest.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    assert set(tensors) == set(manifest["tensors"]), path
    for name, info in manifest["tensors"].items():
        digest = hashlib.sha256(np.ascontiguousarray(tensors[name]).tobytes()).hexdigest()
        assert digest == info["sha256"], f"{path.name}: checksum of {name}"
        tensors[name] = tensors[name].reshape(info["shape"])
    return {"tensors": tensors, "manifest": manifest}
