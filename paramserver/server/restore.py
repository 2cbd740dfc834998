"""Start a shard from another cluster's state: ``paramserver serve --restore-from DIR[,DIR...]``.

When the shard's own ``--checkpoint-dir`` holds no checkpoint yet, :func:`prepare_checkpoint_dir`
writes one there from the old cluster's state before the daemon restores it. Each old shard's
state is what a restart of it would have come back with: its newest checkpoint that verifies
**plus its write-ahead log replayed after it**, so every update it acknowledged is restored,
also when it never wrote a checkpoint (a state directory that holds only a log).

A source ``DIR`` is one old shard's state, in any of the layouts the product writes:

* a state directory holding ``checkpoints/`` and ``wal/`` (the Ray launcher's
  ``<state-dir>/<job>/shard-<i>`` and the Helm chart's ``/data``); either may be missing or empty;
* a checkpoint directory, its log in ``DIR/wal`` (``paramserver serve``'s default ``--wal-dir``)
  or, for a directory named ``checkpoints``, in the sibling ``wal``;
* a directory of such shard directories (``shard-0``, ``shard-1``, ...), e.g. a whole Ray state
  directory of one job.

Which old shard a source was comes from its checkpoints' manifests; a source with no
checkpoint is taken from its ``shard-<i>`` directory name, else from its position in the list
(so list such sources in shard order). A log without a checkpoint is replayed under this
server's own settings (consistency, staleness, aggregation): start the new cluster with the old
one's ``serve`` flags.

* **Same shard count** (and the same consistency and slice size) as the old cluster: shard i
  takes old shard i's whole state, exactly as a restart of it on its own disk would (parameters,
  optimizer state, clocks, BSP step and queued gradients, registrations and dedup windows, so a
  retried push is still applied once).
* **Another shard count**: every old shard's restored state is resharded
  (:mod:`paramserver.server.reshard`): the newest cut common to every old shard, where each
  shard's end state (checkpoint + log) counts as one more checkpoint of it. When the old shards'
  logs end at the same BSP step (or SSP/ASP minimum clock) that is everything they
  acknowledged; otherwise the newest common checkpoint cut, and the workers redo the steps
  after it.

A log with a gap after the checkpoint it follows (segments lost) is refused, naming the
missing records, rather than restored with updates silently missing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.core.shard import ServerCore
from paramserver.server import reshard as resharding
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.checkpoint_cut import shard_manifest
from paramserver.server.config import ServerConfig
from paramserver.server.reshard import ReshardError, parse_sources
from paramserver.server.wal import WalError, WriteAheadLog
from paramserver.server.wal_records import replay_into

logger = logging.getLogger(__name__)

__all__ = ["ShardState", "find_states", "load_state", "prepare_checkpoint_dir"]

_CKPT_PREFIX = "ckpt-"
_WAL_PREFIX = "wal-"
_SHARD_NAME = re.compile(r"shard-(\d+)")
#: Working directory of a restore inside the new checkpoint directory (a name
#: :meth:`CheckpointManager.restore_latest` removes if a crash leaves it behind).
_WORK_PREFIX = ".tmp-restore-"


@dataclass(frozen=True)
class ShardState:
    """One old shard's state as found on disk.

    Attributes:
        path: The directory that holds it (as given, or a ``shard-<i>`` directory in it).
        checkpoint_dir: Its directory of committed checkpoints (None: it has none).
        wal_dir: Its write-ahead-log directory (None: no log segments).
        index: Its shard index in the old cluster.
        num_shards: Shards of the old cluster (None when no checkpoint says).
        manifest: Its newest readable checkpoint manifest (None without a checkpoint).
    """

    path: Path
    checkpoint_dir: Path | None
    wal_dir: Path | None
    index: int
    num_shards: int | None
    manifest: dict[str, Any] | None


def _has_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and any(
        p.name.startswith(_CKPT_PREFIX) and p.is_dir() for p in directory.iterdir()
    )


def _has_log(directory: Path) -> bool:
    return directory.is_dir() and any(
        p.name.startswith(_WAL_PREFIX) and p.is_file() for p in directory.iterdir()
    )


def _shard_info(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's ``shard`` section (a checkpoint written before sharding: shard 0 of 1)."""
    info = manifest.get("shard")
    return info if isinstance(info, dict) else {"shard_index": 0, "num_shards": 1}


def _newest_manifest(directory: Path) -> dict[str, Any] | None:
    for path in sorted(
        (p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_CKPT_PREFIX)),
        reverse=True,
    ):
        try:
            manifest: dict[str, Any] = json.loads(
                (path / "manifest.json").read_text(encoding="utf-8")
            )
        except (OSError, ValueError) as exc:
            logger.warning("skipping unreadable checkpoint %s: %s", path, exc)
            continue
        return manifest
    return None


def _locate(path: Path) -> tuple[Path | None, Path | None]:
    """(checkpoint directory, log directory) of one shard's state at ``path`` (None, None: not
    one shard's state)."""
    ckpt = next((d for d in (path, path / "checkpoints") if _has_checkpoint(d)), None)
    wal_candidates = [path / "wal", path]
    if path.name == "checkpoints":
        wal_candidates.append(path.parent / "wal")
    wal = next((d for d in wal_candidates if _has_log(d)), None)
    return ckpt, wal


def _name_index(path: Path) -> int | None:
    for part in (path.name, path.parent.name if path.name in ("checkpoints", "wal") else ""):
        match = _SHARD_NAME.fullmatch(part)
        if match:
            return int(match.group(1))
    return None


def find_states(sources: Iterable[Path | str]) -> list[ShardState]:
    """Every old shard's state in ``sources``, in shard order (see the module docstring).

    Raises:
        ReshardError: a source that is no directory or holds neither a checkpoint nor a log;
            shards given twice or missing; sources of clusters of different sizes.
    """
    found: list[tuple[Path, Path | None, Path | None]] = []
    for src in sources:
        path = Path(src)
        if not path.is_dir():
            raise ReshardError(f"--restore-from: {path} is not a directory")
        ckpt, wal = _locate(path)
        if ckpt is not None or wal is not None:
            found.append((path, ckpt, wal))
            continue
        subs = [(p, *_locate(p)) for p in path.iterdir() if p.is_dir()]
        subs = [s for s in subs if s[1] is not None or s[2] is not None]
        if not subs:
            raise ReshardError(
                f"--restore-from: {path} holds no committed checkpoint and no write-ahead log "
                "(nor shard directories that do)"
            )
        subs.sort(key=lambda s: (_name_index(s[0]) is None, _name_index(s[0]) or 0, s[0].name))
        found.extend(subs)
    states: list[ShardState] = []
    sizes: set[int] = set()
    for position, (path, ckpt, wal) in enumerate(found):
        manifest = _newest_manifest(ckpt) if ckpt is not None else None
        if manifest is not None:
            info = _shard_info(manifest)
            index, size = int(info["shard_index"]), int(info["num_shards"])
            sizes.add(size)
        else:
            named = _name_index(path)
            index, size = (position if named is None else named), None
        states.append(ShardState(path, ckpt, wal, index, size, manifest))
    if len(sizes) > 1:
        raise ReshardError(
            f"--restore-from: sources of clusters of different sizes {sorted(sizes)}"
        )
    num_shards = sizes.pop() if sizes else len(states)
    indexes = sorted(s.index for s in states)
    if indexes != list(range(num_shards)):
        raise ReshardError(
            f"--restore-from: the old cluster had {num_shards} shard(s); found the state of "
            f"shards {indexes} in {', '.join(str(s.path) for s in states)}: pass one "
            "directory per shard (or their parent)"
        )
    return sorted(
        (dataclasses.replace(s, num_shards=num_shards) for s in states), key=lambda s: s.index
    )


def _contiguous(
    records: Iterator[wal_pb.WalRecord], after: int, where: Path
) -> Iterator[wal_pb.WalRecord]:
    """The records, refusing a gap (a lost segment) after sequence ``after``."""
    expected = after + 1
    for record in records:
        if record.sequence != expected:
            raise ReshardError(
                f"--restore-from: the write-ahead log in {where} lacks records {expected} to "
                f"{record.sequence - 1} after its checkpoint (segments lost): refusing to "
                "restore without them"
            )
        expected += 1
        yield record


def _replay_config(config: ServerConfig, state: ShardState) -> ServerConfig:
    """The settings old shard ``state`` ran under, as far as its checkpoint tells (the rest:
    this server's), with no files of its own."""
    size = state.num_shards or 1
    info = _shard_info(state.manifest) if state.manifest is not None else {}
    addresses = list(info.get("addresses") or [f"unassigned-{i}:0" for i in range(size)])
    return dataclasses.replace(
        config,
        consistency=str((state.manifest or {}).get("consistency", config.consistency)),
        shard_index=state.index,
        shard_addresses=",".join(addresses) if size > 1 else None,
        slice_bytes=int(info.get("slice_bytes", config.slice_bytes)),
        shard_map_epoch=int(info.get("epoch", config.shard_map_epoch)),
        checkpoint_dir=None,
        wal=False,
        wal_dir=None,
        restore_from=None,
        metrics_port=None,
    )


def load_state(state: ShardState, config: ServerConfig) -> tuple[ServerCore, int]:
    """Old shard ``state`` as a restart would restore it: its newest checkpoint that verifies,
    then its log after that checkpoint. Returns the core and the records replayed.

    Args:
        state: The old shard's state (read, never changed).
        config: The settings to rebuild it under (consistency, shard index and count).

    Raises:
        ReshardError: the log does not replay onto the checkpoint, or has a gap.
    """
    core = ServerCore(config)
    after = 0
    if state.checkpoint_dir is not None:
        manager = CheckpointManager(state.checkpoint_dir)
        restored = manager.restore_latest(core)
        if restored is not None:
            after = manager.last_restored_wal_sequence
            logger.info("restore: %s", restored)
    replayed = 0
    if state.wal_dir is not None:
        log = WriteAheadLog(state.wal_dir)
        try:
            replayed = replay_into(core, _contiguous(log.replay(after), after, state.wal_dir))
        except WalError as exc:
            raise ReshardError(f"--restore-from {state.wal_dir}: {exc}") from exc
    logger.info(
        "restore: old shard %d (%s): %d write-ahead-log record(s) replayed after sequence %d",
        state.index,
        state.path,
        replayed,
        after,
    )
    return core, replayed


def _same_shape(config: ServerConfig, states: Sequence[ShardState]) -> bool:
    """Whether shard i of this cluster can take old shard i's whole state."""
    if len(states) != config.num_shards:
        return False
    for s in states:
        if s.manifest is None:
            continue
        info = _shard_info(s.manifest)
        if int(info.get("slice_bytes", config.slice_bytes)) != config.slice_bytes:
            return False
        if str(s.manifest.get("consistency", config.consistency)) != config.consistency:
            return False
    return True


def restore(config: ServerConfig, directory: Path) -> dict[str, Any]:
    """Write this shard's checkpoint of the state in ``config.restore_from`` into
    ``directory`` (see the module docstring); returns a summary (also logged).

    Raises:
        ReshardError: sources that cannot be restored (named).
    """
    states = find_states(parse_sources(config.restore_from or ""))
    own = dataclasses.replace(
        config, checkpoint_dir=None, wal=False, wal_dir=None, restore_from=None, metrics_port=None
    )
    if _same_shape(config, states):
        state = states[config.shard_index]
        core, replayed = load_state(state, own)
        path = CheckpointManager(directory).save(core)
        return {
            "mode": "whole state",
            "from": str(state.path),
            "from_shard": state.index,
            "replayed_records": replayed,
            "applied_updates": core.applied_updates,
            "written": [str(path)],
        }
    # Another shape: each old shard's end state becomes one more checkpoint beside its own
    # (linked, not copied), and the newest cut common to all of them is resharded.
    work = directory / f"{_WORK_PREFIX}{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        dirs = []
        for state in states:
            out = work / f"shard-{state.index}"
            out.mkdir(parents=True)
            if state.checkpoint_dir is not None:
                for ckpt in sorted(state.checkpoint_dir.iterdir()):
                    if ckpt.is_dir() and ckpt.name.startswith(_CKPT_PREFIX):
                        (out / ckpt.name).symlink_to(ckpt.resolve(), target_is_directory=True)
            core, _ = load_state(state, _replay_config(own, state))
            logger.info("restore: old shard %d ends at %s", state.index, shard_manifest(core))
            CheckpointManager(out, keep=1 << 30).save(core)
            dirs.append(out)
        summary = resharding.reshard(
            dirs,
            config.num_shards,
            [directory] * config.num_shards,  # only this shard's part is written
            slice_bytes=config.slice_bytes,
            addresses=(
                [a.strip() for a in config.shard_addresses.split(",") if a.strip()]
                if config.shard_addresses
                else None
            ),
            only=config.shard_index,
            allow_inexact=True,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"mode": "resharded", **summary}


def prepare_checkpoint_dir(config: ServerConfig) -> None:
    """Before a shard restores: restore ``restore_from`` into an empty checkpoint directory
    (:func:`restore`), then refuse a checkpoint written for another place in another cluster
    (:func:`paramserver.server.reshard.prepare_checkpoint_dir`).

    Raises:
        ReshardError: unrestorable sources, or the newest checkpoint belongs to another shard
            index or shard count.
    """
    if config.checkpoint_dir and config.restore_from:
        directory = Path(config.checkpoint_dir)
        if not _has_checkpoint(directory):
            directory.mkdir(parents=True, exist_ok=True)
            summary = restore(config, directory)
            logger.info(
                "restored shard %d of %d from %s: %s",
                config.shard_index,
                config.num_shards,
                config.restore_from,
                summary,
            )
    resharding.prepare_checkpoint_dir(config)
