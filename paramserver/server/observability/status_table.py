"""What ``paramserver status ADDRESS`` prints: aligned tables for people, JSON for programs.

The table shows the cluster line (consistency, staleness, live workers, minimum clock, BSP
step, counters), the workers ranked slowest first (under BSP by total barrier lag, the time the
fastest worker waited on each — see :mod:`paramserver.server.observability.hooks`; otherwise by
clock), with
clock, lease left, heartbeat age and barrier wait, then the keys with dtype, shape, bytes and
update rule, then the embedding tables (rows stored, bytes per row, rows pulled and pushed per
second, filtered and expired ids, the hit rate workers' row caches reported). ``--json``
prints every field of ``StatusResponse``, zero and false ones too, with 64-bit integers as
JSON numbers (protobuf's JSON mapping writes them as strings).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tables_pb2 as tpb

if TYPE_CHECKING:
    # (what ``Message.DESCRIPTOR`` is typed as besides the Python Descriptor: the upb one)
    from google._upb._message import Descriptor as UpbDescriptor

__all__ = ["cache_hit_rate", "render_status", "status_to_dict", "straggler_order", "table_lines"]

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def status_to_dict(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-ready dict: every field (defaults included), proto field names,
    64-bit integers as numbers."""
    out = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _ints_as_numbers(message.DESCRIPTOR, out)
    return dict(out)


def _ints_as_numbers(descriptor: Descriptor | UpbDescriptor, data: dict[str, Any]) -> None:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for k, v in list(value.items()):
                if value_field.type in _INT64_TYPES:
                    value[k] = int(v)
                elif value_field.message_type is not None:
                    _ints_as_numbers(value_field.message_type, v)
        elif field.message_type is not None:
            items = value if isinstance(value, list) else [value]
            for item in items:
                _ints_as_numbers(field.message_type, item)
        elif field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def _enum_name(message: Message, field: str, prefix: str) -> str:
    desc = message.DESCRIPTOR.fields_by_name[field].enum_type
    number = getattr(message, field)
    value = desc.values_by_number.get(number) if desc is not None else None
    name = value.name if value is not None else str(number)
    return name.removeprefix(prefix).lower()


def straggler_order(status: pb.StatusResponse) -> list[pb.WorkerInfo]:
    """Workers of a ``StatusResponse``, slowest first.

    Under BSP by total barrier lag (descending), then by lowest clock; otherwise by lowest
    clock. Departed workers come last. Ties keep name order.
    """
    bsp = _enum_name(status.view, "consistency", "CONSISTENCY_") == "bsp"
    return sorted(
        status.workers,
        key=lambda w: (
            not w.live,
            -w.barrier_lag_ms if bsp else 0,
            w.clock,
            w.worker_name,
        ),
    )


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.3f} s"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def checkpoint_text(status: pb.StatusResponse) -> str:
    """``ckpt-... 3.2 s ago``, ``ckpt-... (restored at start, written 1 h ago)`` or ``none``."""
    name = getattr(status, "last_checkpoint", "")
    if not status.last_checkpoint_age_ms and not name:
        return "none"
    age = f"{status.last_checkpoint_age_ms / 1000:.1f} s" if status.last_checkpoint_age_ms else "?"
    if getattr(status, "last_checkpoint_restored", False):
        return f"{name} (restored at start, written {age} ago)"
    return f"{name} {age} ago".strip()


def render_status(status: pb.StatusResponse, address: str = "") -> str:
    """The human view of a ``StatusResponse`` (tables of plain aligned text, newline-ended)."""
    view = status.view
    consistency = _enum_name(view, "consistency", "CONSISTENCY_").upper()
    bsp = consistency == "BSP"  # the death policy and the step mean something under BSP only
    lines = [
        f"paramserver {address}".rstrip()
        + f": {consistency} (staleness {view.staleness}), aggregation "
        f"{_enum_name(status, 'aggregation', 'AGGREGATION_')}"
        + (f", BSP policy {status.bsp_policy or '-'}" if bsp else ""),
        f"live workers {view.live_workers}   min clock {view.min_clock}   "
        + (f"BSP step {status.bsp_step}   " if bsp else "")
        + f"membership epoch {view.membership_epoch}",
        f"applied updates {status.applied_updates}   duplicate {status.duplicate_pushes}   "
        f"rejected {status.rejected_pushes}   dropped stale {status.dropped_stale}   "
        f"in flight {status.inflight_pushes}",
    ]
    dropped = {k: v for k, v in sorted(status.dropped_updates.items()) if v}
    if dropped:
        lines.append("not applied: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    checkpoint = checkpoint_text(status)
    lines.append(
        f"last checkpoint {checkpoint}   WAL sequence {status.wal_sequence}   RSS "
        f"{_bytes(status.rss_bytes)}   asyncio tasks {status.asyncio_tasks}"
    )
    lines.append("")
    workers = straggler_order(status)
    lines.append(f"WORKERS ({len(workers)}, slowest first)")
    rows = [
        [
            str(i + 1),
            w.worker_name,
            w.worker_id,
            "yes" if w.live else "no",
            str(w.clock),
            _seconds(w.lease_remaining_ms) if w.live else "-",
            _seconds(w.heartbeat_age_ms),
            _seconds(w.barrier_lag_ms),
            _seconds(w.barrier_wait_ms),
            str(w.barrier_steps),
            str(w.applied_updates),
        ]
        for i, w in enumerate(workers)
    ]
    headers = [
        "#",
        "name",
        "id",
        "live",
        "clock",
        "lease left",
        "heartbeat age",
        "barrier lag",
        "barrier wait",
        "steps",
        "applied",
    ]
    lines += _table(headers, rows, right={0, 4, 5, 6, 7, 8, 9, 10})
    lines.append("")
    lines.append(f"KEYS ({len(status.keys)})")
    key_rows = [
        [
            k.key,
            _enum_name(k, "dtype", "DTYPE_"),
            "(" + ", ".join(str(d) for d in k.shape) + ("," if len(k.shape) == 1 else "") + ")",
            str(k.size_bytes),
            _enum_name(k, "rule", "RULE_KIND_"),
            str(k.updates),
        ]
        for k in status.keys
    ]
    lines += _table(["key", "dtype", "shape", "bytes", "rule", "updates"], key_rows, right={3, 5})
    if status.tables:
        lines.append("")
        lines += table_lines(status.tables)
    return "\n".join(lines) + "\n"


def cache_hit_rate(info: tpb.TableInfo) -> str:
    """``87.5%`` of the rows workers' row caches served, or ``-`` when none reported."""
    if not info.cache_rows_requested:
        return "-"
    return f"{100.0 * info.cache_rows_hit / info.cache_rows_requested:.1f}%"


def table_lines(tables: Iterable[tpb.TableInfo]) -> list[str]:
    """The TABLES section: per embedding table what users watch (rows stored, memory per row,
    rows pulled and pushed per second, filtered and expired ids, the cache hit rate workers
    reported)."""
    headers = [
        "table",
        "dim",
        "dtype",
        "rows",
        "bytes/row",
        "pulled/s",
        "pushed/s",
        "rows pulled",
        "rows pushed",
        "filtered",
        "expired",
        "cache hit",
    ]
    rows = [
        [
            t.spec.name,
            str(t.spec.dim),
            _enum_name(t.spec, "dtype", "DTYPE_"),
            str(t.rows),
            f"{t.bytes_per_row:.1f}" if t.rows else "-",
            f"{t.rows_pulled_per_s:.0f}",
            f"{t.rows_pushed_per_s:.0f}",
            str(t.rows_pulled),
            str(t.rows_pushed),
            str(t.filtered),
            str(t.expired),
            cache_hit_rate(t),
        ]
        for t in tables
    ]
    return [f"TABLES ({len(rows)})", *_table(headers, rows, right=set(range(1, 12)) - {2})]
