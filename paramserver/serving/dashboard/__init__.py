"""The built-in dashboard of every metrics port: ``/`` (a page), ``/api/status`` (its JSON).

The page (``index.html``, ``app.js``, ``style.css`` beside this module, served by
the process itself, nothing from a CDN) polls ``/api/status`` once a second and draws what it
returns; see docs/observability.md for what each panel shows.

:class:`Dashboard` keeps the recent history: a sampler task on the server's own event loop reads
the metrics registry every ``period_s`` seconds (the same collection a Prometheus scrape runs)
and keeps the cumulative counters of the last ``history`` samples, so rates (pushes/s, pulled
bytes/s, transfer bytes/s) are differences of two samples divided by the seconds between them,
as Prometheus ``rate()`` computes them. Per sample, by kind of server:

* ``ps`` (a parameter-server shard): see
  :mod:`paramserver.server.observability.shard_dashboard`. The JSON adds the shard's ``Status``
  (what ``paramserver status --json`` prints) and, in a sharded cluster, every other shard's,
  read over gRPC from the addresses of the shard map.
* ``rank`` (a rank server): bytes and commands per transfer direction, tiers and path.
* ``reduce`` (a reduction server): RPCs per method.

The endpoint has the metrics port's access rules (bind address; no tokens): it shows what the
Prometheus series show, plus the shards' ``Status``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from importlib import resources

from prometheus_client import CollectorRegistry

from paramserver.closing import cancelled

logger = logging.getLogger(__name__)

__all__ = [
    "ASSETS",
    "DEFAULT_HISTORY",
    "PEER_TIMEOUT_S",
    "Dashboard",
    "Sampler",
    "Series",
    "asset",
    "gather_peers",
    "rank_sample",
    "read_samples",
    "rpc_sample",
    "series_by",
    "series_sum",
]

#: Files of the page, served at ``/<name>`` (``/`` is ``index.html``), with their content type.
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

#: Samples kept (at one a second: the last five minutes).
DEFAULT_HISTORY = 300
#: Seconds a read of another shard's Status may take.
PEER_TIMEOUT_S = 2.0

#: ``(labels, value)`` pairs of one sample name.
Series = list[tuple[dict[str, str], float]]


@functools.cache
def _version() -> str:
    """The installed distribution's version (``unknown`` when run from a source tree)."""
    try:
        return importlib.metadata.version("paramserver")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def asset(name: str) -> bytes:
    """The bytes of page file ``name`` (one of :data:`ASSETS`), read from the package data."""
    return (resources.files(__name__) / name).read_bytes()


def read_samples(registry: CollectorRegistry) -> dict[str, Series]:
    """Every sample of ``registry`` now, by sample name (``_total``, ``_bucket``... suffixes
    included, as the text exposition names them)."""
    out: dict[str, Series] = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def series_sum(series: Series | None, **match: str) -> float:
    return sum(v for labels, v in series or [] if all(labels.get(k) == m for k, m in match.items()))


def series_by(series: Series | None, label: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in series or []:
        if all(labels.get(k) == m for k, m in match.items()):
            name = labels.get(label, "")
            out[name] = out.get(name, 0.0) + v
    return out


def _transfer_label(labels: dict[str, str]) -> str:
    return (
        f"{labels.get('direction', '?')} {labels.get('src_tier', '?')}->"
        f"{labels.get('dst_tier', '?')} {labels.get('path', '?')}"
    )


def _by_transfer(series: Series | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in series or []:
        name = _transfer_label(labels)
        out[name] = out.get(name, 0.0) + v
    return out


def rank_sample(s: dict[str, Series]) -> dict[str, float | dict[str, float]]:
    """The history entry of a rank server: bytes and commands per direction, tiers and path."""
    return {
        "transfer_bytes": _by_transfer(s.get("paramserver_rank_transfer_bytes_total")),
        "transfers": _by_transfer(s.get("paramserver_rank_transfers_total")),
        "transfer_s": _by_transfer(s.get("paramserver_rank_transfer_seconds_sum")),
        "failed": series_sum(s.get("paramserver_rank_commands_failed_total")),
        "inflight": series_sum(s.get("paramserver_rank_inflight_commands")),
    }


def rpc_sample(s: dict[str, Series]) -> dict[str, float | dict[str, float]]:
    """The history entry of any gRPC server: RPCs per method (all outcomes)."""
    return {"rpcs": series_by(s.get("paramserver_rpcs_total"), "method")}


def _sampled_at(entry: Mapping[str, object]) -> float:
    """The Unix time of a history entry (its ``t``)."""
    t = entry["t"]
    assert isinstance(t, int | float)
    return t


#: What a sample holds, by kind of server.
Sampler = Callable[[dict[str, Series]], Mapping[str, object]]


class Dashboard:
    """The history and the JSON behind a metrics port's page.

    A kind of server with more to show subclasses it (a shard's:
    :class:`~paramserver.server.observability.shard_dashboard.ShardDashboard`, kind ``ps``),
    adding its sampler to :attr:`SAMPLERS` and its facts in :meth:`_sampled` and
    :meth:`_facts`.

    Args:
        kind: A key of :attr:`SAMPLERS`: ``rank`` or ``reduce`` here (what the samples and the
            page show).
        registry: The metrics registry the endpoint exposes.
        info: Static facts about the server shown on the page (address, shard index...).
        status: Returns this shard's Status as a dict (``paramserver status --json``); ps only.
        peers: Returns the other shards of the cluster as dicts ``{"index", "address",
            "status"}`` or ``{"index", "address", "error"}``; ps only, None for one shard.
        period_s: Seconds between two samples.
        history: Samples kept.
        now: Wall clock in Unix seconds (injectable for tests).
    """

    #: The sample of each kind of server, from its registry's samples.
    SAMPLERS: dict[str, Sampler] = {"rank": rank_sample, "reduce": rpc_sample}

    def __init__(
        self,
        kind: str,
        registry: CollectorRegistry,
        *,
        info: Mapping[str, object] | None = None,
        status: Callable[[], Awaitable[Mapping[str, object]]] | None = None,
        peers: Callable[[], Awaitable[list[dict[str, object]]]] | None = None,
        period_s: float = 1.0,
        history: int = DEFAULT_HISTORY,
        now: Callable[[], float] = time.time,
    ) -> None:
        if kind not in self.SAMPLERS:
            raise ValueError(
                f"dashboard kind must be one of {', '.join(self.SAMPLERS)}, got {kind!r}"
            )
        self.kind = kind
        self.registry = registry
        self.info = dict(info or {})
        self.status = status
        self.peers = peers
        self.period_s = period_s
        self.now = now
        self.history: deque[dict[str, object]] = deque(maxlen=history)
        self._task: asyncio.Task[None] | None = None
        self._sample_failed = False
        self._peers_lock = asyncio.Lock()
        self._peers_at = -float("inf")
        self._peers_view: list[dict[str, object]] = []

    def sample(self) -> dict[str, object]:
        """Read the registry once and append the entry to :attr:`history` (returned)."""
        samples = read_samples(self.registry)
        t = round(self.now(), 3)
        entry = {"t": t, **self.SAMPLERS[self.kind](samples)}
        self.history.append(entry)
        self._sampled(t, samples)
        return entry

    def _sampled(self, t: float, samples: dict[str, Series]) -> None:
        """Called with every sample taken at Unix time ``t`` (a subclass keeps more of it)."""

    def _facts(self) -> dict[str, object]:
        """What the snapshot adds for this kind of server (a subclass's)."""
        return {}

    async def start(self) -> None:
        """Take the first sample and start sampling every ``period_s`` seconds."""
        self.sample()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="paramserver-dashboard-sampler"
        )

    async def stop(self) -> None:
        """Stop sampling (the history stays readable)."""
        await cancelled(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.sample()
            except Exception:  # a collector failing must not end the history
                if not self._sample_failed:  # its traceback once, not every second
                    logger.exception("dashboard sample failed (later failures: DEBUG)")
                else:
                    logger.debug("dashboard sample failed", exc_info=True)
                self._sample_failed = True

    async def _peer_view(self) -> list[dict[str, object]]:
        """The other shards' Status, read at most once per ``period_s`` whoever polls."""
        assert self.peers is not None
        async with self._peers_lock:
            if time.monotonic() - self._peers_at >= self.period_s:
                self._peers_view = await self.peers()
                self._peers_at = time.monotonic()
            return self._peers_view

    async def snapshot(self, since_unix_s: float | None = None) -> dict[str, object]:
        """What ``GET /api/status`` answers: the server's facts (and its kind's,
        :meth:`_facts`), its Status and its peers' when given, and the history (oldest first,
        cumulative counters; only the samples after ``since_unix_s`` when given)."""
        out: dict[str, object] = {
            "kind": self.kind,
            "version": _version(),
            "now_unix_s": round(self.now(), 3),
            "period_s": self.period_s,
            "server": self.info,
        }
        out.update(self._facts())
        if self.status is not None:
            out["status"] = await self.status()
        if self.peers is not None:
            out["shards"] = await self._peer_view()
        if since_unix_s is None:
            out["history"] = list(self.history)
        else:
            out["history"] = [h for h in self.history if _sampled_at(h) > since_unix_s]
        return out

    async def body(self, query: str = "") -> bytes:
        """:meth:`snapshot` as compact JSON; ``query`` is the request's query string
        (``since=<Unix seconds>``: only the newer samples, what the page polls for).

        Raises:
            ValueError: ``since`` is not a number.
        """
        since = urllib.parse.parse_qs(query).get("since")
        since_unix_s = float(since[0]) if since else None
        return json.dumps(await self.snapshot(since_unix_s), separators=(",", ":")).encode()


async def gather_peers(
    addresses: Iterable[tuple[int, str]],
    read: Callable[[str], Awaitable[Mapping[str, object]]],
    timeout_s: float = PEER_TIMEOUT_S,
) -> list[dict[str, object]]:
    """Read every peer's Status at once (one task per peer); a peer that fails or does not
    answer within ``timeout_s`` is reported with its error, the others still are."""

    async def one(index: int, address: str) -> dict[str, object]:
        try:
            status = await asyncio.wait_for(read(address), timeout_s)
        except Exception as exc:
            detail = getattr(exc, "details", None)
            text = detail() if callable(detail) else str(exc)
            return {"index": index, "address": address, "error": text or type(exc).__name__}
        return {"index": index, "address": address, "status": status}

    return list(await asyncio.gather(*(one(i, a) for i, a in addresses)))
