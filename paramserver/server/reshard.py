"""Restore a sharded cluster's checkpoints into a different number of shards.

The checkpoints of S shards that share one ``cut_step`` (see
:mod:`paramserver.server.checkpoint_cut`) form
one consistent cut of the cluster. Resharding picks the newest cut every source shard has, loads
and verifies those S checkpoints, merges them into the logical model (sliced tensors and their
optimizer state reassembled bit-exactly from their slices), places the model on N shards under
the same rule (:mod:`paramserver.core.sharding`), and writes one committed checkpoint per new shard:

    paramserver reshard --from ckpt/shard-0 ckpt/shard-1 ckpt/shard-2 --to-shards 2 --out new/
    # new/shard-0, new/shard-1: start shard i with --checkpoint-dir new/shard-i

or, on load, ``paramserver serve --restore-from ckpt/shard-0,ckpt/shard-1,ckpt/shard-2 ...``:
a shard whose own checkpoint directory is still empty writes its part of the cut there first.

The resharded state is the cut's parameters, optimizer state and step (BSP) / minimum clock
(SSP/ASP), and every embedding table's rows, optimizer state and frequency-filter counts, each
row moved to shard ``hash64(table, id) mod N``, and each worker name's progress (the fewest
iterations any old shard counted for it); worker registrations, push dedup tables and
BSP gradients (dense or rows) queued in the open step are not carried over (workers of the new
cluster register afresh, start at the cut's clock and redo that step). Sources may also be
directories holding ``shard-*`` checkpoint directories (the layout this tool writes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import NameProgress, ServerCore
from paramserver.core.sharding import (
    DEFAULT_SLICE_BYTES,
    TensorLayout,
    decode_layout,
    encode_layout,
    home_shard,
    layout_key,
    parse_name,
    plan_layout,
)
from paramserver.core.store import Entry, ParameterStore
from paramserver.core.table_set import TablesManifest, merge_table_states, split_table_states
from paramserver.errors import InvalidArgument, ParamServerError
from paramserver.server.checkpoint import CheckpointError, CheckpointManager
from paramserver.server.config import ServerConfig

logger = logging.getLogger(__name__)

_PREFIX = "ckpt-"


class ReshardError(ParamServerError):
    """Checkpoints that cannot be resharded: no common cut, missing slices, mixed clusters."""


@dataclass
class LogicalEntry:
    """One user key of the merged model (values and optimizer state in the key's full shape)."""

    key: str
    value: np.ndarray
    rule: UpdateRule
    state: dict[str, np.ndarray]
    updates: int


#: What :func:`reshard` did (``paramserver reshard`` prints it as JSON): the cut's step and
#: exactness, the old shards' count and checkpoints (``from``, in shard order), the new
#: cluster's shard count and slice size, the logical keys, and the checkpoints written.
#: (The functional form: ``from`` is a Python keyword.)
ReshardSummary = TypedDict(
    "ReshardSummary",
    {
        "cut_step": int,
        "exact_cut": bool,
        "from_shards": int,
        "from": list[str],
        "to_shards": int,
        "slice_bytes": int,
        "keys": int,
        "written": list[str],
    },
)


@dataclass(frozen=True)
class Cut:
    """One checkpoint per source shard, all at ``step``, in shard-index order."""

    step: int
    exact: bool
    paths: tuple[Path, ...]
    manifests: tuple[dict[str, Any], ...]


# ------------------------------------------------------------------------------ finding a cut
def _shard_info(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's shard section; legacy (pre-sharding) checkpoints are shard 0 of 1."""
    info = manifest.get("shard")
    if isinstance(info, dict):
        return info
    bsp = manifest.get("consistency") == "bsp"
    return {
        "shard_index": 0,
        "num_shards": 1,
        "slice_bytes": DEFAULT_SLICE_BYTES,
        "epoch": 0,
        "cut_step": int(manifest["bsp_step"] if bsp else manifest["min_clock"]),
        "exact_cut": False,
    }


def _committed(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def expand_sources(sources: Iterable[Path | str]) -> list[Path]:
    """Shard checkpoint directories: each source itself, or its ``shard-*`` subdirectories.

    Raises:
        ReshardError: a source that is not a directory or holds no checkpoint.
    """
    out: list[Path] = []
    for src in sources:
        path = Path(src)
        if not path.is_dir():
            raise ReshardError(f"checkpoint source {path} is not a directory")
        if _committed(path):
            out.append(path)
            continue
        subs = sorted(p for p in path.iterdir() if p.is_dir() and _committed(p))
        if not subs:
            raise ReshardError(f"checkpoint source {path} holds no committed checkpoint")
        out.extend(subs)
    return out


def find_cut(sources: Sequence[Path | str], *, allow_inexact: bool = False) -> Cut:
    """The newest cut that every source shard has a checkpoint of.

    Args:
        sources: One checkpoint directory per shard of the old cluster (any order), or
            directories holding ``shard-*`` subdirectories.
        allow_inexact: Accept SSP/ASP cuts (see :mod:`paramserver.server.checkpoint_cut`).

    Raises:
        ReshardError: shards missing or duplicated, or no cut common to all of them.
    """
    dirs = expand_sources(sources)
    per_shard: dict[int, dict[int, tuple[Path, dict[str, Any]]]] = {}
    sizes: set[int] = set()
    for directory in dirs:
        cuts: dict[int, tuple[Path, dict[str, Any]]] = {}
        index: int | None = None
        for path in _committed(directory):
            try:
                manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
                info = _shard_info(manifest)
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("skipping unreadable checkpoint %s: %s", path, exc)
                continue
            index = int(info["shard_index"])
            sizes.add(int(info["num_shards"]))
            if info.get("exact_cut") or allow_inexact:
                cuts[int(info["cut_step"])] = (path, manifest)  # newest wins per step
        if index is None:
            raise ReshardError(f"{directory}: no readable checkpoint")
        if index in per_shard:
            raise ReshardError(f"shard {index} given twice (second: {directory})")
        per_shard[index] = cuts
    if len(sizes) != 1:
        raise ReshardError(f"sources come from clusters of different sizes: {sorted(sizes)}")
    (num_shards,) = sizes
    if sorted(per_shard) != list(range(num_shards)):
        raise ReshardError(
            f"the old cluster had {num_shards} shards; got checkpoints of shards "
            f"{sorted(per_shard)}: pass one directory per shard"
        )
    common = set.intersection(*(set(c) for c in per_shard.values()))
    if not common:
        listing = "; ".join(f"shard {i}: {sorted(c)}" for i, c in sorted(per_shard.items()))
        kind = "cuts" if allow_inexact else "exact cuts (BSP step boundaries)"
        raise ReshardError(f"no common cut among the shards' {kind}: {listing}")
    step = max(common)
    chosen = [per_shard[i][step] for i in range(num_shards)]
    exact = all(bool(_shard_info(m).get("exact_cut")) for _, m in chosen)
    return Cut(step, exact, tuple(p for p, _ in chosen), tuple(m for _, m in chosen))


# ------------------------------------------------------------------------------ merge / split
def _sliced_state(name: str, key: str, parts: list[np.ndarray], layout: TensorLayout) -> np.ndarray:
    first = parts[0]
    if first.shape == ():  # per-slice scalar (adam's step): equal on every slice
        for p in parts[1:]:
            if not np.array_equal(p, first):
                raise ReshardError(f"key {key!r}: state {name!r} differs between slices")
        return first.copy()
    out = np.empty(layout.size, dtype=first.dtype)
    for j, part in enumerate(parts):
        start, stop = layout.bounds(j)
        if part.size != stop - start:
            raise ReshardError(f"key {key!r}: state {name!r} of slice {j} has the wrong size")
        out[start:stop] = part.reshape(-1)
    return out.reshape(layout.shape)


def merge_stores(stores: Sequence[ParameterStore]) -> dict[str, LogicalEntry]:
    """The logical model held by the shards' stores (sliced keys reassembled).

    Raises:
        ReshardError: a stored name on two shards, a slice or layout missing, or slices that
            disagree on their rule.
    """
    stored: dict[str, Entry] = {}
    for store in stores:
        for name in store.keys():
            if name in stored:
                raise ReshardError(f"{name!r} is stored on two shards")
            stored[name] = store.get(name)
    out: dict[str, LogicalEntry] = {}
    layouts: dict[str, TensorLayout] = {}
    for name, entry in stored.items():
        kind, key, _, _ = parse_name(name)
        if kind == "layout":
            layouts[key] = decode_layout(key, entry.value)
        elif kind == "plain":
            out[key] = LogicalEntry(
                key, entry.value, entry.rule, dict(entry.state), int(entry.updates)
            )
    for key, layout in layouts.items():
        names = layout.names()
        missing = [n for n in names if n not in stored]
        if missing:
            raise ReshardError(f"key {key!r}: slices {missing} are missing from the checkpoints")
        entries = [stored[n] for n in names]
        rule = entries[0].rule
        if any(e.rule != rule for e in entries):
            raise ReshardError(f"key {key!r}: slices disagree on the update rule")
        value = np.empty(layout.size, dtype=layout.dtype)
        for j, e in enumerate(entries):
            start, stop = layout.bounds(j)
            value[start:stop] = e.value.reshape(-1)
        state = {
            sname: _sliced_state(sname, key, [e.state[sname] for e in entries], layout)
            for sname in entries[0].state
        }
        out[key] = LogicalEntry(
            key, value.reshape(layout.shape), rule, state, int(entries[0].updates)
        )
    extra = sorted(
        n for n in stored if parse_name(n)[0] == "slice" and parse_name(n)[1] not in layouts
    )
    if extra:
        raise ReshardError(f"slices without a layout tensor: {extra}")
    return out


def split_model(
    model: Mapping[str, LogicalEntry], num_shards: int, slice_bytes: int = DEFAULT_SLICE_BYTES
) -> list[dict[str, LogicalEntry]]:
    """Place the logical model on ``num_shards`` shards: stored name -> entry, per shard."""
    out: list[dict[str, LogicalEntry]] = [{} for _ in range(num_shards)]
    for key, entry in model.items():
        layout = plan_layout(key, entry.value.dtype, entry.value.shape, slice_bytes)
        if not layout.sliced:
            out[home_shard(key, num_shards)][key] = entry
            continue
        where = layout.placement(num_shards)
        lk = layout_key(key)
        out[where[lk]][lk] = LogicalEntry(lk, encode_layout(layout), UpdateRule("assign"), {}, 0)
        flat = entry.value.reshape(-1)
        flat_state = {s: a.reshape(-1) if a.shape else a for s, a in entry.state.items()}
        for j, name in enumerate(layout.names()):
            start, stop = layout.bounds(j)
            state = {
                s: (a[start:stop].copy() if entry.state[s].shape else a.copy())
                for s, a in flat_state.items()
            }
            out[where[name]][name] = LogicalEntry(
                name, flat[start:stop].copy(), entry.rule, state, entry.updates
            )
    return out


def _store_of(entries: Mapping[str, LogicalEntry]) -> ParameterStore:
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, object] = {}
    for name, e in entries.items():
        tensors[f"param/{name}"] = e.value
        for sname, array in e.state.items():
            tensors[f"state/{name}/{sname}"] = array
        meta[name] = {
            "rule": e.rule.to_dict(),
            "dtype": str(e.value.dtype),
            "shape": list(e.value.shape),
            "updates": e.updates,
        }
    return ParameterStore.from_state_dict(tensors, meta)


# ------------------------------------------------------------------------------ the tool
def _load_checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One verified checkpoint of the cut: its tensors and manifest.

    Raises:
        ReshardError: the checkpoint does not verify (the path named).
    """
    try:
        return CheckpointManager(path.parent).load(path)
    except CheckpointError as exc:
        raise ReshardError(f"{path}: {exc}") from exc


def load_model(cut: Cut) -> dict[str, LogicalEntry]:
    """Load and verify the cut's checkpoints and merge them into the logical model."""
    stores = [
        ParameterStore.from_state_dict(tensors, manifest["store"])
        for tensors, manifest in map(_load_checkpoint, cut.paths)
    ]
    return merge_stores(stores)


def load_tables(cut: Cut) -> tuple[dict[str, np.ndarray], TablesManifest]:
    """The cut's embedding tables merged into one (rows moved by id on the way out)."""
    parts = [
        ({k: v for k, v in tensors.items() if k.startswith("table/")}, manifest.get("tables", {}))
        for tensors, manifest in map(_load_checkpoint, cut.paths)
    ]
    return merge_table_states(parts)


def reshard(
    sources: Sequence[Path | str],
    num_shards: int,
    out: Path | str | Sequence[Path | str],
    *,
    slice_bytes: int | None = None,
    addresses: Sequence[str] | None = None,
    only: int | None = None,
    allow_inexact: bool = False,
) -> ReshardSummary:
    """Write the newest common cut of ``sources`` as checkpoints of ``num_shards`` shards.

    Args:
        sources: Checkpoint directories of the old cluster (one per shard, or their parent).
        num_shards: Shards of the new cluster.
        out: A directory (shard i is written to ``out/shard-i``) or one directory per new shard.
        slice_bytes: Slice size of the new cluster (default: the old cluster's).
        addresses: The new cluster's shard addresses (recorded in the manifests; the serving
            shards' own configuration decides).
        only: Write only this new shard's checkpoint (restore-time resharding).
        allow_inexact: Accept SSP/ASP cuts (see :func:`find_cut`).

    Returns:
        A summary: cut step, exactness, keys, and the directories written.

    Raises:
        ReshardError / InvalidArgument: no common cut, bad arguments, unreadable checkpoints.
    """
    if num_shards < 1:
        raise InvalidArgument(f"num_shards must be >= 1, got {num_shards}")
    if isinstance(out, str | Path):
        out_dirs = [Path(out) / f"shard-{i}" for i in range(num_shards)]
    else:
        out_dirs = [Path(p) for p in out]
        if len(out_dirs) != num_shards:
            raise InvalidArgument(f"{len(out_dirs)} output directories for {num_shards} shards")
    if addresses is not None and len(addresses) != num_shards:
        raise InvalidArgument(f"{len(addresses)} addresses for {num_shards} shards")
    cut = find_cut(sources, allow_inexact=allow_inexact)
    first = cut.manifests[0]
    old = _shard_info(first)
    slice_bytes = int(slice_bytes or old.get("slice_bytes", DEFAULT_SLICE_BYTES))
    model = load_model(cut)
    placed = split_model(model, num_shards, slice_bytes)
    tables = split_table_states(*load_tables(cut), num_shards)
    consistency = str(first.get("consistency", "bsp"))
    applied = max(int(m.get("applied_updates", 0)) for m in cut.manifests)
    epoch = max(int(m.get("membership_epoch", 0)) for m in cut.manifests) + 1
    incarnations = max(int(m.get("incarnations", 0)) for m in cut.manifests)
    progress = _merged_progress(cut.manifests)
    addr = list(addresses) if addresses else [f"unassigned-{i}:0" for i in range(num_shards)]
    written = []
    for i in range(num_shards):
        if only is not None and i != only:
            continue
        config = ServerConfig(
            consistency=consistency,
            shard_index=i,
            shard_addresses=",".join(addr) if num_shards > 1 else None,
            slice_bytes=slice_bytes,
            shard_map_epoch=int(old.get("epoch", 0)) + 1,
        )
        core = ServerCore(config)
        core.store = _store_of(placed[i])
        core.tables.restore(*tables[i])
        core.applied_updates = applied
        core.cluster.epoch = epoch
        core.cluster.incarnations = incarnations
        core.cluster.restore_floor(cut.step)
        core.progress = {name: NameProgress(*p) for name, p in progress.items()}
        if core.aggregator is not None:
            core.aggregator.current_step = cut.step
        path = CheckpointManager(out_dirs[i]).save(core)
        written.append(str(path))
        logger.info("shard %d of %d: %d stored tensors -> %s", i, num_shards, len(placed[i]), path)
    return {
        "cut_step": cut.step,
        "exact_cut": cut.exact,
        "from_shards": len(cut.paths),
        "from": [str(p) for p in cut.paths],
        "to_shards": num_shards,
        "slice_bytes": slice_bytes,
        "keys": len(model),
        "written": written,
    }


def _merged_progress(manifests: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each worker name's (steps, clock) over the cut's shards: the fewest iterations any
    shard counted (every shard counts every iteration of a name, so the fewest is what all of
    them saw end); a name some shard never counted is left out."""
    each = [
        {
            str(n): (int(steps), int(clock))
            for n, (steps, clock) in (m.get("progress") or {}).items()
        }
        for m in manifests
    ]
    common = set(each[0]).intersection(*each[1:]) if each else set()
    return {name: min(p[name] for p in each) for name in sorted(common)}


# ------------------------------------------------------------------------------ daemon hooks
def prepare_checkpoint_dir(config: ServerConfig) -> None:
    """Before a shard restores: refuse checkpoints written for another place in another
    cluster (``--restore-from`` is restored before this, by
    :func:`paramserver.server.restore.prepare_checkpoint_dir`).

    Raises:
        ReshardError: the newest checkpoint belongs to another shard index or shard count.
    """
    if not config.checkpoint_dir:
        return
    directory = Path(config.checkpoint_dir)
    existing = _committed(directory) if directory.is_dir() else []
    for path in reversed(existing):
        try:
            info = _shard_info(json.loads((path / "manifest.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError):
            continue
        if (int(info["shard_index"]), int(info["num_shards"])) != (
            config.shard_index,
            config.num_shards,
        ):
            raise ReshardError(
                f"checkpoint {path} was written by shard {info['shard_index']} of "
                f"{info['num_shards']}, but this is shard {config.shard_index} of "
                f"{config.num_shards}: reshard it first (paramserver reshard, or serve "
                "--restore-from with an empty --checkpoint-dir)"
            )
        return


def parse_sources(text: str) -> list[Path]:
    """``"a,b,c"`` -> paths (restore_from / PARAMSERVER_RESTORE_FROM)."""
    return [Path(p.strip()) for p in text.split(",") if p.strip()]
