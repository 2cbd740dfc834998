"""Which replica of a shard is primary, decided by etcd under an epoch (never a consensus here).

etcd (v3 API through its own HTTP/JSON gateway, ``/v3/...``) holds two keys per shard under
``<prefix>/shard-<i>/``:

- ``primary``: ``{"index": k, "address": "host:port"}``, attached to the primary's lease. Its
  ``create_revision`` is the **epoch**: etcd revisions only grow, so every new primary holds a
  higher epoch than any before it.
- ``sync``: the replica indexes that hold every acknowledged record (the primary and its
  backups in sync), written only by a transaction that checks the writer still holds the
  ``primary`` key under its epoch.

Every replica keeps a lease of ``election_ttl_s`` seconds alive. A replica that is not primary
polls the ``primary`` key; when it is gone (its holder's lease lapsed: killed, partitioned,
stopped) and this replica is in ``sync`` (at the first start: replica 0 only), it creates the
key with its own lease and sets ``sync`` to itself in one transaction that succeeds only if
the key is still absent and ``sync`` unchanged: at most one replica wins, under a new epoch.
A primary that has not renewed its lease for ``election_ttl_s`` (measured from the renewal
sent, so it gives up no later than etcd expires it), or whose key is gone or names another
epoch, stops being primary at once (:meth:`Replica.demote
<paramserver.server.replication.Replica.demote>`).

A backup that took over holds every acknowledged record (it was in ``sync``); a deposed
primary can acknowledge nothing more: its backups have seen the newer epoch and refuse it,
and it cannot drop them from ``sync`` without the ``primary`` key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias

from paramserver.closing import cancelled
from paramserver.errors import Unavailable
from paramserver.protocol.addresses import parse_addresses
from paramserver.server.config import ServerConfig
from paramserver.server.replication import Replica

logger = logging.getLogger(__name__)

#: How often a replica that is not primary reads the ``primary`` key (seconds).
POLL_S = 0.1
#: Deadline of one etcd request (seconds).
REQUEST_TIMEOUT_S = 2.0


#: A comparison of a transaction, in the gateway's JSON (base64 ``key``, ``target``,
#: ``result``, and ``create_revision`` or ``mod_revision`` as decimal text).
Compare: TypeAlias = dict[str, str]
#: An operation of a transaction: ``{"request_put": {"key", "value"[, "lease"]}}`` (base64).
Operation: TypeAlias = dict[str, dict[str, str]]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Etcd:
    """The few etcd v3 calls the election needs, over etcd's HTTP/JSON gateway (urllib, run in
    a worker thread). Tries each endpoint in turn.

    Args:
        endpoints: ``host:port`` of etcd's client URLs.
    """

    def __init__(self, endpoints: tuple[str, ...]) -> None:
        self.endpoints = endpoints
        self._next = 0

    def _post_sync(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        errors = []
        for k in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._next + k) % len(self.endpoints)]
            req = urllib.request.Request(
                f"http://{endpoint}{path}",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                    out: dict[str, Any] = json.loads(resp.read())
                self._next = (self._next + k) % len(self.endpoints)
                return out
            except (OSError, urllib.error.URLError, ValueError) as exc:
                errors.append(f"{endpoint}: {exc}")
        raise Unavailable(f"etcd {path} failed: {'; '.join(errors)}")

    async def post(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """POST one v3 gateway call; its JSON answer.

        Raises:
            Unavailable: no endpoint answered (UNAVAILABLE).
        """
        return await asyncio.to_thread(self._post_sync, path, body)

    async def grant(self, ttl_s: int) -> str:
        return str((await self.post("/v3/lease/grant", {"TTL": ttl_s}))["ID"])

    async def keepalive(self, lease: str) -> int:
        """Renew ``lease``; its remaining TTL in seconds (0: the lease is gone)."""
        out = await self.post("/v3/lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", 0))

    async def get(self, key: str) -> dict[str, Any] | None:
        """The key's kv (``value`` decoded, revisions as int), or None."""
        out = await self.post("/v3/kv/range", {"key": _b64(key)})
        kvs = out.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return {
            "value": base64.b64decode(kv.get("value", "")).decode(),
            "create_revision": int(kv.get("create_revision", 0)),
            "mod_revision": int(kv.get("mod_revision", 0)),
        }

    async def txn(self, compare: list[Compare], success: list[Operation]) -> tuple[bool, int]:
        """One transaction: ``(succeeded, revision after it)``."""
        out = await self.post("/v3/kv/txn", {"compare": compare, "success": success})
        return bool(out.get("succeeded", False)), int(out["header"]["revision"])

    @staticmethod
    def put(key: str, value: str, lease: str | None = None) -> Operation:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        return {"request_put": body}

    @staticmethod
    def revision_is(key: str, target: str, revision: int) -> Compare:
        """Compare ``key``'s ``CREATE`` or ``MOD`` revision with ``revision`` (0: absent)."""
        field = "create_revision" if target == "CREATE" else "mod_revision"
        return {"key": _b64(key), "target": target, "result": "EQUAL", field: str(revision)}


class ElectionStore(Protocol):
    """The authority an :class:`Election` campaigns at: etcd's v3 calls the election uses, with
    etcd's meaning (leases with a TTL, revisions that only grow, transactions in the gateway's
    JSON shape built by :meth:`Etcd.put` and :meth:`Etcd.revision_is`). :class:`Etcd` is one;
    the Ray launcher's authority actor is another
    (:mod:`paramserver.integrations.ray.authority`). Every call raises
    :class:`~paramserver.errors.Unavailable` when the authority cannot be reached."""

    async def grant(self, ttl_s: int) -> str: ...

    async def keepalive(self, lease: str) -> int: ...

    async def get(self, key: str) -> dict[str, Any] | None: ...

    async def txn(self, compare: list[Compare], success: list[Operation]) -> tuple[bool, int]: ...


def address_key(prefix: str, shard_index: int, replica_index: int) -> str:
    """The key under which a replica that moved (placed again on another host) publishes its
    new client address; the primary streams to it there from then on."""
    return f"{prefix.rstrip('/')}/shard-{shard_index}/replica-{replica_index}/address"


#: How often a primary reads its backups' published addresses (seconds).
ADDRESS_POLL_S = 1.0


class Election:
    """Campaigns for the primary role of one shard replica and keeps or gives it up.

    Args:
        config: The replica's configuration (``election_*``, ``shard_index``,
            ``replica_index``).
        replica: The replica it promotes and demotes.
        store: The authority (default: etcd at ``config.election_endpoints``).
    """

    def __init__(
        self, config: ServerConfig, replica: Replica, store: ElectionStore | None = None
    ) -> None:
        if store is None:
            assert config.election_endpoints is not None
            store = Etcd(parse_addresses(config.election_endpoints))
        self.store = store
        self.prefix = config.election_prefix
        self.shard_index = config.shard_index
        self._cluster_read = 0.0
        self.num_shards = config.num_shards
        self.replicas = config.replicas
        #: Replicas of any shard that published a new address after a move, by (shard,
        #: replica): the shard map this replica serves names them there (see
        #: :func:`moved_groups`), so a client discovering the cluster now finds every shard.
        self.moved: dict[tuple[int, int], str] = {}
        self.replica = replica
        self.index = config.replica_index
        self.address = config.replica_address_list[config.replica_index]
        self.ttl_s = config.election_ttl_s
        base = f"{config.election_prefix.rstrip('/')}/shard-{config.shard_index}"
        self.primary_key = f"{base}/primary"
        self.sync_key = f"{base}/sync"
        self.lease: str | None = None
        #: Monotonic time the last renewal that succeeded was sent.
        self.renewed_at = 0.0
        self.epoch = 0
        self._task: asyncio.Task[None] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._said_empty = False

    async def start(self) -> None:
        """Take a lease and start campaigning (returns at once)."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="paramserver-election")

    async def stop(self) -> None:
        await cancelled(self._keepalive)
        await cancelled(self._task)

    # ------------------------------------------------------------------ the lease
    async def _new_lease(self) -> None:
        sent = time.monotonic()
        self.lease = await self.store.grant(self.ttl_s)
        self.renewed_at = sent
        await cancelled(self._keepalive)
        self._keepalive = asyncio.get_running_loop().create_task(
            self._keep_alive(self.lease), name="paramserver-election-lease"
        )

    async def _keep_alive(self, lease: str) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 4)
            sent = time.monotonic()
            try:
                ttl = await self.store.keepalive(lease)
            except Unavailable as exc:
                logger.warning("election: lease renewal failed: %s", exc.message)
                continue
            if ttl <= 0:
                logger.warning("election: lease %s lapsed", lease)
                return
            self.renewed_at = max(self.renewed_at, sent)

    def lease_valid(self) -> bool:
        return self.lease is not None and time.monotonic() - self.renewed_at < self.ttl_s

    # ------------------------------------------------------------------ roles
    async def _run(self) -> None:
        while True:
            try:
                if not self.lease_valid():
                    if self.replica.primary is not None:
                        await self.replica.demote("its etcd lease lapsed")
                    await self._new_lease()
                if self.replica.primary is not None:
                    await self._check_still_primary()
                else:
                    await self._campaign()
                if time.monotonic() - self._cluster_read >= ADDRESS_POLL_S:
                    await self._read_cluster_addresses()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd unreachable: a primary keeps its lease's rule
                logger.warning("election: %s", getattr(exc, "message", repr(exc)))
            await asyncio.sleep(POLL_S)

    async def _check_still_primary(self) -> None:
        kv = await self.store.get(self.primary_key)
        if kv is None or kv["create_revision"] != self.epoch:
            await self.replica.demote(f"etcd names another primary (epoch {self.epoch} ended)")
            return

    async def _read_cluster_addresses(self) -> None:
        """Every shard's moved replicas (:attr:`moved`), read from the store; a primary then
        streams to each of its backups at the address it published, if it moved."""
        self._cluster_read = time.monotonic()
        for shard in range(self.num_shards):
            for k in range(self.replicas):
                kv = await self.store.get(address_key(self.prefix, shard, k))
                if kv is not None:
                    self.moved[(shard, k)] = kv["value"]
        if self.replica.primary is None:
            return
        for k, address in enumerate(self.replica.addresses):
            now = self.moved.get((self.shard_index, k), address)
            if k != self.index and now != address:
                self.replica.move(k, now)

    async def _campaign(self) -> None:
        kv = await self.store.get(self.primary_key)
        if kv is not None:
            self.replica.backup.observe_epoch(kv["create_revision"])
            return
        sync = await self.store.get(self.sync_key)
        members = json.loads(sync["value"]) if sync is not None else [0]
        if self.index not in members:
            return  # not in sync: it may lack acknowledged records
        if sync is not None and not self.replica.holds_state:
            if not self._said_empty:
                self._said_empty = True
                logger.info(
                    "replica %d of shard %d holds no state yet (nothing restored from its disk, "
                    "no primary has streamed to it): it waits for the primary's seed before it "
                    "stands for election",
                    self.index,
                    self.shard_index,
                )
            return
        assert self.lease is not None
        won, revision = await self.store.txn(
            [
                Etcd.revision_is(self.primary_key, "CREATE", 0),
                Etcd.revision_is(self.sync_key, "MOD", sync["mod_revision"] if sync else 0),
            ],
            [
                Etcd.put(
                    self.primary_key,
                    json.dumps({"index": self.index, "address": self.address}),
                    self.lease,
                ),
                Etcd.put(self.sync_key, json.dumps([self.index])),
            ],
        )
        if not won:
            return
        self.epoch = revision
        await self.replica.promote(revision, sync_changed=self._record_sync)

    async def _record_sync(self, members: set[int]) -> bool:
        """Write the replicas in sync, only while this replica holds the primary key under its
        epoch; False when it no longer does (or etcd cannot be reached)."""
        if not self.lease_valid():
            return False
        try:
            done, _ = await self.store.txn(
                [Etcd.revision_is(self.primary_key, "CREATE", self.epoch)],
                [Etcd.put(self.sync_key, json.dumps(sorted(members)))],
            )
        except Unavailable as exc:
            logger.warning("election: cannot record the replicas in sync: %s", exc.message)
            return False
        return done


def moved_groups(groups: Sequence[str], moved: Mapping[tuple[int, int], str]) -> tuple[str, ...]:
    """Each shard's ``"h:p|h:p"`` replica group with the replicas that moved at their new
    addresses (``moved``: (shard, replica) -> address, as :class:`Election` reads them)."""
    out = []
    for shard, group in enumerate(groups):
        replicas = group.split("|")
        for k in range(len(replicas)):
            replicas[k] = moved.get((shard, k), replicas[k])
        out.append("|".join(replicas))
    return tuple(out)
