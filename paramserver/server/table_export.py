"""Export trained embedding tables for serving, and load them back.

An export is a directory::

    tables.json              {"format": "paramserver-tables/1", "tables": {name: {"spec": ...,
                              "rows": n, "file": "table-0000.safetensors", "dtype": ...}}}
    table-0000.safetensors   "ids": int64 (n,) stored ids, ascending (the id index: a row's
                             position is searchsorted(ids, id)); "rows": (n, dim) stored rows
                             (float32 / float16; bfloat16 as its raw uint16 bits)

written from the newest committed checkpoint of each shard of a cluster (rows of every shard
merged; optimizer state, filter counts and queues left out). :class:`ExportedTables` loads it
and answers pulls exactly as the training cluster did: a stored id gets its stored row, bit for
bit, and any other id its initial row (a pure function of the table's seed and the id), as a
pull of an unstored id does on the cluster. :func:`load_export` installs an export in a shard's
tables, which is what ``paramserver serve --read-only --from-export DIR`` serves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file, save_file

from paramserver.core.table_set import (
    TableSet,
    TablesManifest,
    merge_table_states,
    split_table_states,
)
from paramserver.core.tables import EmbeddingTable, TableSpec
from paramserver.errors import InvalidArgument, TableNotFound
from paramserver.server.checkpoint import CheckpointError, CheckpointManager

__all__ = [
    "EXPORT_FORMAT",
    "ExportedTables",
    "export_state",
    "export_tables",
    "load_export",
    "read_checkpoint_tables",
]

#: The ``format`` value of ``tables.json``.
EXPORT_FORMAT = "paramserver-tables/1"


def read_checkpoint_tables(
    directories: Sequence[Path],
) -> tuple[dict[str, np.ndarray], TablesManifest]:
    """Every table of the newest committed checkpoint of each shard's directory, merged (one
    directory per shard, any order).

    Raises:
        CheckpointError: a directory without a committed checkpoint, or one that does not
            verify.
    """
    parts = []
    for directory in directories:
        manager = CheckpointManager(Path(directory))
        committed = manager.committed()
        if not committed:
            raise CheckpointError(f"{directory}: no committed checkpoint")
        tensors, manifest = manager.load(committed[-1])
        tables = manifest.get("tables", {"tables": {}})
        parts.append(({k: v for k, v in tensors.items() if k.startswith("table/")}, tables))
    return merge_table_states(parts)


def _storable(rows: np.ndarray) -> np.ndarray:
    return rows.view(np.uint16) if rows.dtype == ml_dtypes.bfloat16 else rows


def export_tables(
    directories: Sequence[Path], out: Path, *, tables: Sequence[str] | None = None
) -> dict[str, int]:
    """Write the export of the tables in the shards' newest checkpoints to ``out``.

    Args:
        directories: Each shard's checkpoint directory.
        out: The export directory (created; files in it are replaced).
        tables: Names to export (default: every table).

    Returns:
        Rows written per table.

    Raises:
        CheckpointError: as :func:`read_checkpoint_tables`. TableNotFound: a name in
            ``tables`` that the checkpoints do not hold (NOT_FOUND).
    """
    arrays, manifest = read_checkpoint_tables(directories)
    have = manifest.get("tables", {})
    names = list(have) if tables is None else list(tables)
    for name in names:
        if name not in have:
            raise TableNotFound(f"table {name!r} is not in the checkpoints ({sorted(have)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, dict[str, object]] = {}
    written = {}
    for i, name in enumerate(names):
        spec = TableSpec.from_dict(have[name]["spec"])
        ids = np.ascontiguousarray(arrays[f"table/{name}/ids"], dtype=np.int64)
        rows = np.ascontiguousarray(arrays[f"table/{name}/rows"])
        file = f"table-{i:04d}.safetensors"
        tmp = out / (file + ".tmp")
        save_file({"ids": ids, "rows": _storable(rows)}, str(tmp))
        os.replace(tmp, out / file)
        index[name] = {
            "spec": spec.to_dict(),
            "rows": int(ids.shape[0]),
            "file": file,
            "dtype": spec.dtype,
        }
        written[name] = int(ids.shape[0])
    tmp_index = out / "tables.json.tmp"
    tmp_index.write_text(
        json.dumps({"format": EXPORT_FORMAT, "tables": index}, indent=1, sort_keys=True),
        encoding="utf-8",
    )
    os.replace(tmp_index, out / "tables.json")
    return written


def _read_export(directory: Path) -> dict[str, tuple[TableSpec, np.ndarray, np.ndarray]]:
    """name -> (declaration, stored ids (n,) int64, rows (n, dim) in the storage dtype).

    Raises:
        InvalidArgument: not an export of this format, or a file that does not match its
            index (INVALID_ARGUMENT).
    """
    directory = Path(directory)
    try:
        index = json.loads((directory / "tables.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{directory}: not a table export ({exc})") from exc
    if index.get("format") != EXPORT_FORMAT:
        raise InvalidArgument(
            f"{directory}: export format {index.get('format')!r}, expected {EXPORT_FORMAT!r}"
        )
    out = {}
    for name, entry in index["tables"].items():
        spec = TableSpec.from_dict(entry["spec"])
        raw = load_file(str(directory / entry["file"]))
        ids = raw["ids"].astype(np.int64, copy=False)
        rows = raw["rows"]
        if spec.np_dtype == ml_dtypes.bfloat16:
            rows = rows.view(ml_dtypes.bfloat16)
        if rows.shape != (ids.shape[0], spec.dim) or rows.dtype != spec.np_dtype:
            raise InvalidArgument(
                f"{directory}: table {name!r}: rows {rows.dtype} {rows.shape} do not match "
                f"{ids.shape[0]} ids of dim {spec.dim} ({spec.dtype})"
            )
        out[name] = (spec, ids, rows)
    return out


def export_state(directory: Path) -> tuple[dict[str, np.ndarray], TablesManifest]:
    """An export as the state of one shard holding every row
    (:meth:`~paramserver.core.table_set.TableSet.state`'s arrays and manifest): stored ids and
    rows, zero optimizer state, no filter counts, no queued pushes.

    Raises:
        InvalidArgument: as :func:`_read_export` (INVALID_ARGUMENT).
    """
    arrays: dict[str, np.ndarray] = {}
    manifest: TablesManifest = {"tables": {}, "dedup": {}}
    for name, (spec, ids, rows) in _read_export(directory).items():
        n = ids.shape[0]
        for field, empty in EmbeddingTable(spec).state_arrays().items():  # fields, dtypes
            arrays[f"table/{name}/{field}"] = np.zeros((n, *empty.shape[1:]), empty.dtype)
        arrays[f"table/{name}/ids"] = ids
        arrays[f"table/{name}/rows"] = rows
        arrays[f"table/{name}/pending_ids"] = np.zeros(0, np.int64)
        arrays[f"table/{name}/pending_counts"] = np.zeros(0, np.int64)
        manifest["tables"][name] = {"spec": spec.to_dict(), "newest_clock": -1, "queued": []}
    return arrays, manifest


def load_export(
    tables: TableSet, directory: Path, *, shard_index: int = 0, num_shards: int = 1
) -> dict[str, int]:
    """Replace ``tables`` by an export's tables: in a cluster of ``num_shards`` shards, the
    rows of the ids shard ``shard_index`` owns (``hash64(table, id) mod S``), so each
    read-only shard answers its ids as the training cluster did.

    Returns:
        Rows loaded per table.

    Raises:
        InvalidArgument: as :func:`export_state` (INVALID_ARGUMENT).
    """
    arrays, manifest = export_state(directory)
    if num_shards > 1:
        arrays, manifest = split_table_states(arrays, manifest, num_shards)[shard_index]
    tables.restore(arrays, manifest)
    return {name: int(t.n) for name, t in tables.tables.items()}


class ExportedTables:
    """Tables loaded from an export: pulls as the training cluster answered them.

    Args:
        directory: An export written by :func:`export_tables`.

    Raises:
        InvalidArgument: not an export of this format, or a file that does not match its
            index (INVALID_ARGUMENT).
    """

    def __init__(self, directory: Path) -> None:
        loaded = TableSet()
        load_export(loaded, Path(directory))
        self.tables: dict[str, EmbeddingTable] = loaded.tables

    def specs(self) -> dict[str, TableSpec]:
        """Every table's declaration."""
        return {name: t.spec for name, t in self.tables.items()}

    def pull(self, table: str, ids: npt.ArrayLike) -> np.ndarray:
        """Rows of ``ids`` (the caller's order): stored rows, or the initial row of an id the
        export does not hold.

        Raises:
            TableNotFound (NOT_FOUND), InvalidArgument: bad ids (INVALID_ARGUMENT).
        """
        t = self.tables.get(table)
        if t is None:
            raise TableNotFound(f"table {table!r} is not in this export ({sorted(self.tables)})")
        return t.pull(t.check_ids(np.asarray(ids)))
