"""The authority that elects each replicated shard's primary in a Ray job.

On Ray the launcher is the authority (no etcd is needed on the cluster): it starts one
:class:`Authority` actor pinned to its own node, and every shard replica campaigns there
through :class:`RayElectionStore`, with exactly the calls and the meaning
:class:`~paramserver.server.election.Election` uses against etcd: leases with a TTL, a
revision number that only grows (a new primary's **epoch**), and compare-and-put
transactions. Nothing is agreed among the replicas themselves; the actor is the one place
that decides, and Ray's actor registry keeps it where the launcher is (a lost launcher node
ends the job, as the loss of Ray's head does).

A replica that stops renewing its lease (its node died, it was partitioned, it hung) loses
the ``primary`` key when the lease lapses, and an in-sync backup takes it under a higher
revision. A replica that Ray placed again on another node publishes its new address under
:func:`~paramserver.server.election.address_key`; the primary streams to it there.

The actor also counts, for the job's result, each shard's promotions (failovers are the
promotions after the first) and each worker task's starts (retries are the starts after the
first).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from paramserver.errors import Unavailable

if TYPE_CHECKING:
    from ray.actor import ActorHandle

#: Deadline of one call to the authority actor (seconds).
CALL_TIMEOUT_S = 2.0


def _key(b64: str) -> str:
    return base64.b64decode(b64).decode()


class KeyValue(TypedDict):
    """A key's value and revisions, as :meth:`LeaseTable.get` (and etcd) gives them."""

    value: str
    create_revision: int
    mod_revision: int


class _Entry(KeyValue):
    """A stored key: its :class:`KeyValue` and the lease that holds it (None: none)."""

    lease: str | None


class Primary(TypedDict):
    """A shard's primary: its replica index, client address and epoch."""

    index: int
    address: str
    epoch: int


class Report(TypedDict):
    """The authority's counts for the job's result."""

    #: shard index -> [(epoch, replica index)] of each promotion, in order.
    promotions: dict[int, list[tuple[int, int]]]
    #: worker index -> starts of its task.
    worker_starts: dict[int, int]


#: A comparison of a transaction, etcd gateway JSON (base64 ``key``, ``target``, ``result``,
#: ``create_revision`` or ``mod_revision`` as decimal text).
Compare = Mapping[str, str]
#: An operation of a transaction: ``{"request_put": {"key", "value"[, "lease"]}}`` (base64).
Operation = Mapping[str, Mapping[str, str]]


class LeaseTable:
    """Keys, leases and revisions with etcd v3's meaning (the subset an election uses).

    * ``revision`` starts at 1 and grows by one per transaction that writes and per lapse
      of a lease that held keys; a key remembers the revision that created it
      (``create_revision``) and the last that wrote it (``mod_revision``).
    * A lease lapses ``ttl_s`` seconds after it was granted or last renewed; its keys are
      deleted then.

    Args:
        clock: Monotonic time in seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.revision = 1
        self.kvs: dict[str, _Entry] = {}
        #: lease id -> (ttl_s, expiry)
        self.leases: dict[str, tuple[int, float]] = {}
        self._lease_ids = 0

    def _expire(self) -> None:
        now = self.clock()
        gone = {lease for lease, (_, expiry) in self.leases.items() if expiry <= now}
        if not gone:
            return
        for lease in gone:
            del self.leases[lease]
        held = [k for k, kv in self.kvs.items() if kv["lease"] in gone]
        if held:
            self.revision += 1
            for k in held:
                del self.kvs[k]

    def grant(self, ttl_s: int) -> str:
        """A new lease of ``ttl_s`` seconds; its id."""
        self._expire()
        self._lease_ids += 1
        lease = str(self._lease_ids)
        self.leases[lease] = (int(ttl_s), self.clock() + ttl_s)
        return lease

    def keepalive(self, lease: str) -> int:
        """Renew ``lease``: its TTL in seconds, or 0 when it has lapsed."""
        self._expire()
        if lease not in self.leases:
            return 0
        ttl, _ = self.leases[lease]
        self.leases[lease] = (ttl, self.clock() + ttl)
        return ttl

    def get(self, key: str) -> KeyValue | None:
        """``{"value", "create_revision", "mod_revision"}`` of ``key``, or None."""
        self._expire()
        kv = self.kvs.get(key)
        if kv is None:
            return None
        return {
            "value": kv["value"],
            "create_revision": kv["create_revision"],
            "mod_revision": kv["mod_revision"],
        }

    def txn(self, compare: Sequence[Compare], success: Sequence[Operation]) -> tuple[bool, int]:
        """If every comparison holds (etcd gateway JSON: base64 ``key``, ``target`` CREATE or
        MOD, ``result`` EQUAL; an absent key's revisions are 0), apply every ``request_put``
        at one new revision. Returns ``(succeeded, revision after it)``."""
        self._expire()
        for c in compare:
            kv = self.kvs.get(_key(c["key"]))
            field: Literal["create_revision", "mod_revision"] = (
                "create_revision" if c["target"] == "CREATE" else "mod_revision"
            )
            have = kv[field] if kv is not None else 0
            if c.get("result", "EQUAL") != "EQUAL" or have != int(c[field]):
                return False, self.revision
        puts = [op["request_put"] for op in success]
        for put in puts:
            if put.get("lease") is not None and put["lease"] not in self.leases:
                return False, self.revision  # etcd refuses a put to a lapsed lease
        if puts:
            self.revision += 1
        for put in puts:
            key = _key(put["key"])
            old = self.kvs.get(key)
            self.kvs[key] = {
                "value": base64.b64decode(put["value"]).decode(),
                "create_revision": old["create_revision"] if old else self.revision,
                "mod_revision": self.revision,
                "lease": put.get("lease"),
            }
        return True, self.revision


class Authority:
    """The job's authority, as a Ray actor (one per job, on the launcher's node): a
    :class:`LeaseTable` plus the counts the job's result reports."""

    def __init__(self) -> None:
        self.table = LeaseTable()
        #: shard index -> [(epoch, replica index)] of each promotion, in order.
        self.promotions: dict[int, list[tuple[int, int]]] = {}
        #: worker index -> starts of its task.
        self.worker_starts: dict[int, int] = {}

    def grant(self, ttl_s: int) -> str:
        return self.table.grant(ttl_s)

    def keepalive(self, lease: str) -> int:
        return self.table.keepalive(lease)

    def get(self, key: str) -> KeyValue | None:
        return self.table.get(key)

    def txn(self, compare: Sequence[Compare], success: Sequence[Operation]) -> tuple[bool, int]:
        done, revision = self.table.txn(compare, success)
        if done:
            for op in success:
                key = _key(op["request_put"]["key"])
                if key.endswith("/primary"):
                    shard = int(key.rsplit("/", 2)[-2].removeprefix("shard-"))
                    index = int(json.loads(self.table.kvs[key]["value"])["index"])
                    self.promotions.setdefault(shard, []).append((revision, index))
        return done, revision

    def publish(self, key: str, value: str) -> None:
        """Put ``key`` (no lease): a moved replica's address."""
        self.table.txn([], [{"request_put": {"key": _b64(key), "value": _b64(value)}}])

    def worker_started(self, index: int) -> int:
        """Count one start of worker task ``index``; its starts so far."""
        self.worker_starts[index] = self.worker_starts.get(index, 0) + 1
        return self.worker_starts[index]

    def report(self) -> Report:
        """``{"promotions": {shard: [(epoch, replica)]}, "worker_starts": {index: n}}``."""
        return {"promotions": dict(self.promotions), "worker_starts": dict(self.worker_starts)}

    def primary(self, shard: int, prefix: str) -> Primary | None:
        """Shard ``shard``'s primary now: ``{"index", "address", "epoch"}``, or None."""
        kv = self.table.get(f"{prefix.rstrip('/')}/shard-{shard}/primary")
        if kv is None:
            return None
        primary: Primary = json.loads(kv["value"]) | {"epoch": kv["create_revision"]}
        return primary


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class RayElectionStore:
    """An :class:`~paramserver.server.election.ElectionStore` over the job's
    :class:`Authority` actor (each call runs in a worker thread, deadline
    :data:`CALL_TIMEOUT_S`).

    Args:
        actor: The authority actor's handle.
    """

    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor

    async def _call(self, method: str, *args: object) -> Any:
        import ray

        ref = getattr(self.actor, method).remote(*args)
        try:
            return await asyncio.to_thread(ray.get, ref, timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise Unavailable(f"the job's authority actor did not answer {method}: {exc}") from exc

    async def grant(self, ttl_s: int) -> str:
        return str(await self._call("grant", ttl_s))

    async def keepalive(self, lease: str) -> int:
        return int(await self._call("keepalive", lease))

    async def get(self, key: str) -> dict[str, Any] | None:
        out: dict[str, Any] | None = await self._call("get", key)
        return out

    async def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]]
    ) -> tuple[bool, int]:
        done, revision = await self._call("txn", compare, success)
        return bool(done), int(revision)
