"""Checkpoints of a server shard: safetensors + a JSON manifest, committed by atomic rename.

Layout under the checkpoint directory::

    ckpt-00000007/                 # committed (sequence 7)
        tensors.safetensors        # "param/{key}" and "state/{key}/{name}" tensors, and
                                   # "queued/{n}": BSP gradients queued in the open step
        manifest.json              # dtypes, shapes, rules, sha256 per tensor, clocks, dedup,
                                   # applied counts per registration, barrier totals
    .tmp-ckpt-00000008-<pid>/      # being written; ignored and removed on start

A checkpoint is written into a temporary directory, every file fsynced, then renamed into place
and the parent directory fsynced, so a crash leaves either the previous checkpoint or the new
one, never a mixture. Restore verifies every tensor's checksum and falls back to the previous
checkpoint when the newest does not verify. The state saved is one consistent cut: the event loop
is single-threaded and saving runs without yielding, so no push lands half-way through.

bfloat16 tensors are stored as their uint16 bit patterns (safetensors' numpy API knows no
ml_dtypes), with the true dtype in the manifest.

The per-worker counts ``paramserver status`` shows are part of the state: the applied gradients
per registration (``"applied_by_registration"``), the iterations each worker name completed
and the clock it reached (``"progress"``: what a restarted worker resumes its data from) and
the observer's barrier totals per worker name with the clock times of the step still open
(``"observations"``). A checkpoint written
before they were saved restores what can be derived from it: under SSP/ASP each registration's
applied count is the number of its remembered request ids whose push was applied (exact while
its pushes fit the dedup window); under BSP (the ids do not say which step a push joined, and a
worker may push several times in one step) the counts, like the barrier totals, start at 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from paramserver.core.aggregation import GradientUpdate
from paramserver.core.consistency import WorkerRecord
from paramserver.core.shard import NameProgress, ObserverState, PushResult, ServerCore
from paramserver.core.store import ParameterStore
from paramserver.errors import ParamServerError
from paramserver.server.checkpoint_cut import shard_manifest

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_PREFIX = "ckpt-"
_TMP_PREFIX = ".tmp-"
#: Tensors of BSP gradients queued in the open step (acknowledged, not applied yet).
_QUEUED_PREFIX = "queued/"


class CheckpointError(ParamServerError):
    """A checkpoint that cannot be read or verified."""


def _sha256(array: np.ndarray) -> str:
    """SHA-256 of the array's C-order bytes, hashed in place (hashlib releases the GIL)."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return hashlib.sha256(flat.data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_storable(array: np.ndarray) -> tuple[np.ndarray, str]:
    dtype = str(array.dtype)
    if array.dtype == ml_dtypes.bfloat16:
        return np.ascontiguousarray(array).view(np.uint16), "bfloat16"
    return np.ascontiguousarray(array), dtype


def _from_storable(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return array.view(ml_dtypes.bfloat16)
    return array


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of a shard's state, ready to be written."""

    tensors: dict[str, np.ndarray]
    manifest: dict[str, Any]


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _save_tensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """``safetensors.numpy.save_file``, with its I/O failures raised as :class:`OSError`.

    The safetensors library reports a failed write (ENOSPC, EIO) as a ``SafetensorError``
    whose text ends ``(os error N)``; it is re-raised as ``OSError(N)`` so callers can tell a
    full disk from a bug.
    """
    try:
        save_file(tensors, str(path))
    except OSError:
        raise
    except Exception as exc:
        found = _OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc


class CheckpointManager:
    """Writes, lists, prunes and restores checkpoints in one directory.

    Args:
        directory: Where checkpoints live; created if missing.
        keep: Committed checkpoints kept (older ones are deleted after each commit).
    """

    def __init__(self, directory: Path, *, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.keep = max(1, keep)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.last_restored_wal_sequence = 0
        self.last_written_wal_sequence = 0
        self._write_lock = threading.Lock()

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        return sorted(
            p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
        )

    def _next_sequence(self) -> int:
        done = self.committed()
        return int(done[-1].name[len(_PREFIX) :]) + 1 if done else 1

    def save(self, core: ServerCore, *, wal_sequence: int = 0) -> Path:
        """Snapshot ``core`` and write the checkpoint (both here, synchronously).

        Args:
            core: The state to save.
            wal_sequence: Last write-ahead-log record the state reflects (replay resumes after).

        Returns:
            The committed checkpoint directory.

        Raises:
            OSError: the write failed (e.g. disk full); the previous checkpoint is untouched and
                the temporary directory removed.
        """
        return self.write(self.snapshot(core, wal_sequence=wal_sequence))

    def snapshot(self, core: ServerCore, *, wal_sequence: int = 0) -> Snapshot:
        """Copy the state (one consistent cut: call without yielding to the event loop)."""
        tensors, meta = core.store.state_dict()
        queued, release_after_step = core.bsp_queue_state()
        for n, update in enumerate(queued):  # never mutated once queued: no copy needed
            tensors[f"{_QUEUED_PREFIX}{n}"] = update.gradient
        table_arrays, table_manifest = core.tables.state()  # copies (``table/...`` names)
        tensors.update(table_arrays)
        manifest = self._manifest(core, tensors, meta)
        manifest["tables"] = table_manifest
        manifest["bsp_queue"] = {
            "updates": [
                {
                    "tensor": f"{_QUEUED_PREFIX}{n}",
                    "worker_id": u.worker_id,
                    "key": u.layer_id,
                    "step": u.step,
                    "num_samples": u.num_samples,
                }
                for n, u in enumerate(queued)
            ],
            "release_after_step": release_after_step,
        }
        manifest["wal_sequence"] = wal_sequence
        manifest["shard"] = shard_manifest(core)
        return Snapshot(tensors, manifest)

    def write(self, snap: Snapshot) -> Path:
        """Write a snapshot to a temporary directory, fsync, and commit it by atomic rename.

        Safe to run in a worker thread (it touches only the snapshot and the directory).

        Raises:
            OSError: the write failed; the previous checkpoint is untouched.
        """
        with self._write_lock:
            seq = self._next_sequence()
            final = self.directory / f"{_PREFIX}{seq:08d}"
            tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
            for name, info in snap.manifest["tensors"].items():
                if not info["sha256"]:
                    info["sha256"] = _sha256(snap.tensors[name])
            storable = {name: _to_storable(array)[0] for name, array in snap.tensors.items()}
            try:
                tmp.mkdir()
                tensor_file = tmp / "tensors.safetensors"
                _save_tensors(storable, tensor_file)
                with open(tensor_file, "rb") as fh:
                    os.fsync(fh.fileno())
                manifest_file = tmp / "manifest.json"
                with open(manifest_file, "w", encoding="utf-8") as fh:
                    json.dump(snap.manifest, fh, indent=1, sort_keys=True)
                    fh.flush()
                    os.fsync(fh.fileno())
                _fsync_dir(tmp)
                os.rename(tmp, final)
                _fsync_dir(self.directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            for old in self.committed()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.last_written_wal_sequence = int(snap.manifest.get("wal_sequence", 0))
        logger.info("checkpoint %s committed (%d tensors)", final.name, len(snap.tensors))
        return final

    @staticmethod
    def _manifest(
        core: ServerCore, tensors: dict[str, np.ndarray], meta: dict[str, object]
    ) -> dict[str, Any]:
        cluster = core.cluster
        return {
            "format_version": FORMAT_VERSION,
            "created_unix_s": time.time(),
            "consistency": core.consistency.value,
            "tensors": {
                name: {
                    "dtype": _to_storable(a)[1],
                    "shape": list(a.shape),
                    "sha256": "",  # computed by write(), off the event loop
                }
                for name, a in tensors.items()
            },
            "store": meta,
            "applied_updates": core.applied_updates,
            "applied_by_registration": dict(core.applied_by_registration),
            "progress": {name: [p.steps, p.clock] for name, p in core.progress.items()},
            "observations": core.observer.state(),
            "bsp_step": core.bsp_step,
            "min_clock": cluster.min_clock(),
            "membership_epoch": cluster.epoch,
            "incarnations": cluster.incarnations,
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "name": w.name,
                    "incarnation": w.incarnation,
                    "clock": w.clock,
                    "client_nonce": w.client_nonce,
                }
                for w in cluster.live_workers()
            ],
            "dedup": {
                wid: [[rid, r.dropped_stale, r.queued] for rid, r in seen.items()]
                for wid, seen in core.dedup_state().items()
            },
        }

    def load(self, path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Read and verify one checkpoint.

        Raises:
            CheckpointError: missing files, bad JSON, or a checksum that does not match.
        """
        try:
            manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
            raw = load_file(str(path / "tensors.safetensors"))
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"checkpoint {path.name} unreadable: {exc}") from exc
        tensors = {}
        for name, info in manifest["tensors"].items():
            if name not in raw:
                raise CheckpointError(f"checkpoint {path.name}: tensor {name!r} missing")
            array = _from_storable(raw[name], info["dtype"])
            if _sha256(array) != info["sha256"]:
                raise CheckpointError(f"checkpoint {path.name}: checksum mismatch for {name!r}")
            tensors[name] = array.reshape(info["shape"])
        return tensors, manifest

    def restore_latest(self, core: ServerCore) -> Path | None:
        """Remove partial checkpoints, then restore the newest one that verifies into ``core``."""
        for p in self.directory.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                logger.warning("removing partial checkpoint %s", p.name)
                shutil.rmtree(p, ignore_errors=True)
        for path in reversed(self.committed()):
            try:
                tensors, manifest = self.load(path)
            except CheckpointError as exc:
                logger.error("%s; trying an older checkpoint", exc)
                continue
            self._apply(core, tensors, manifest)
            self.last_restored_wal_sequence = int(manifest.get("wal_sequence", 0))
            return path
        return None

    @staticmethod
    def _apply(core: ServerCore, tensors: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
        core.store = ParameterStore.from_state_dict(tensors, manifest["store"])
        if "tables" in manifest:
            core.tables.restore(
                {k: v for k, v in tensors.items() if k.startswith("table/")}, manifest["tables"]
            )
        core.applied_updates = int(manifest["applied_updates"])
        cluster = core.cluster
        cluster.epoch = int(manifest["membership_epoch"])
        cluster.incarnations = int(manifest["incarnations"])
        cluster.restore_floor(int(manifest["min_clock"]))
        if core.aggregator is not None:
            core.aggregator.current_step = int(manifest["bsp_step"])
            for key in core.store.keys():
                core.aggregator.declare_layer(key, tuple(core.store.get(key).value.shape))
        now = time.monotonic()
        for w in manifest["workers"]:
            rec = WorkerRecord(
                worker_id=w["worker_id"],
                name=w["name"],
                incarnation=int(w["incarnation"]),
                clock=int(w["clock"]),
                lease_expiry_s=now + cluster.lease_s,
                client_nonce=w.get("client_nonce", ""),
            )
            cluster.workers[rec.worker_id] = rec
            if core.aggregator is not None:
                core.aggregator.register_worker(rec.worker_id, now)
        dedup: dict[str, OrderedDict[int, PushResult]] = {}
        for wid, rows in manifest["dedup"].items():
            if wid not in cluster.workers:  # an older checkpoint keyed them by worker name
                wid = next((w.worker_id for w in cluster.live_workers() if w.name == wid), wid)
            dedup[wid] = OrderedDict(
                (int(rid), PushResult(True, core.applied_updates, bool(stale), bool(queued)))
                for rid, stale, queued in rows
            )
        core.restore_dedup(dedup)
        if "applied_by_registration" in manifest:
            core.applied_by_registration = {
                str(wid): int(n) for wid, n in manifest["applied_by_registration"].items()
            }
        else:  # written before the counts were saved: what the dedup windows tell
            core.applied_by_registration = _applied_counts_from_dedup(core, dedup)
        core.progress = {  # (a checkpoint written before progress was kept: none)
            str(name): NameProgress(int(steps), int(clock))
            for name, (steps, clock) in (manifest.get("progress") or {}).items()
        }
        observations: ObserverState = manifest.get("observations") or ObserverState()
        core.observer.restore(observations)
        queue = manifest.get("bsp_queue") or {"updates": [], "release_after_step": {}}
        core.restore_bsp_queue(
            [
                GradientUpdate(
                    u["worker_id"],
                    u["key"],
                    tensors[u["tensor"]],
                    int(u["step"]),
                    now,
                    int(u["num_samples"]),
                )
                for u in queue["updates"]
            ],
            {wid: int(c) for wid, c in queue["release_after_step"].items()},
            now,
        )


def _applied_counts_from_dedup(
    core: ServerCore, dedup: dict[str, OrderedDict[int, PushResult]]
) -> dict[str, int]:
    """Applied gradients per registration as far as a checkpoint without the counts tells.

    Under SSP/ASP a remembered request id whose push was neither dropped as stale nor queued
    was applied once, so the count is exact while the registration's pushes fit the dedup
    window (:data:`~paramserver.core.dedup.DEDUP_WINDOW` ids; beyond it, a lower bound).
    Under BSP nothing exact follows (the ids do not say which step a push joined, a worker may
    push several times in one step, aborted steps dropped theirs): every count starts at 0.
    """
    if core.aggregator is not None:
        return {}
    counts = {
        wid: sum(1 for r in seen.values() if not r.dropped_stale and not r.queued)
        for wid, seen in dedup.items()
    }
    return {wid: n for wid, n in counts.items() if n}
