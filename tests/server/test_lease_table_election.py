"""The Ray launcher's authority (:class:`~paramserver.integrations.ray.authority.LeaseTable`)
without Ray: its etcd semantics, and two real replica daemons of one shard electing a primary
through it, failing over when the primary stops renewing its lease, and streaming to a backup
that moved to another address.

Expected values are independent of the product: the etcd v3 rules the table claims (revisions
only grow, a lapsed lease deletes its keys, a create-if-absent transaction wins once) and the
sum of the gradients pushed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paramserver.core.optimizers import UpdateRule
from paramserver.integrations.ray.authority import Authority, LeaseTable
from paramserver.server.config import ServerConfig
from paramserver.server.election import Etcd, address_key
from paramserver.server.shard_daemon import ParameterServerDaemon
from paramserver.worker_client import RetryPolicy, connect
from tests.harness.polling import eventually
from tests.harness.timing import scaled

pytestmark = [pytest.mark.timeout(120)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_table_keeps_etcd_semantics() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.grant(2)
    create = [Etcd.revision_is("p", "CREATE", 0)]
    won, rev = table.txn(create, [Etcd.put("p", "a", lease)])
    assert won and rev == 2
    assert table.get("p") == {"value": "a", "create_revision": 2, "mod_revision": 2}
    lost, rev2 = table.txn(create, [Etcd.put("p", "b")])  # present: the create loses
    assert not lost and rev2 == 2 and table.get("p")["value"] == "a"  # type: ignore[index]
    clock.now += 1.5
    assert table.keepalive(lease) == 2  # renewed: lives 2 s from now
    clock.now += 1.9
    assert table.get("p") is not None
    clock.now += 0.2  # 2.1 s since the renewal: lapsed, its key gone, the revision grew
    assert table.get("p") is None
    assert table.keepalive(lease) == 0
    assert table.revision == 3
    # a put to a lapsed lease is refused and changes nothing
    assert table.txn([], [Etcd.put("q", "x", lease)]) == (False, 3)
    # a new primary's create revision (its epoch) is higher than any before it
    other = table.grant(2)
    won, rev = table.txn(create, [Etcd.put("p", "c", other)])
    assert won and rev == 4 and table.get("p")["create_revision"] == 4  # type: ignore[index]
    # MOD comparisons
    assert not table.txn([Etcd.revision_is("p", "MOD", 3)], [Etcd.put("s", "1")])[0]
    assert table.txn([Etcd.revision_is("p", "MOD", 4)], [Etcd.put("s", "1")]) == (True, 5)


def test_authority_counts_promotions_and_worker_starts() -> None:
    auth = Authority()
    lease = auth.grant(5)
    key = "job/shard-1/primary"
    create = [Etcd.revision_is(key, "CREATE", 0)]
    assert auth.txn(create, [Etcd.put(key, '{"index": 0, "address": "a"}', lease)])[0]
    assert auth.primary(1, "job") == {"index": 0, "address": "a", "epoch": 2}
    assert auth.primary(0, "job") is None
    auth.worker_started(3)
    auth.worker_started(3)
    assert auth.report() == {"promotions": {1: [(2, 0)]}, "worker_starts": {3: 2}}
    auth.publish(address_key("job", 1, 1), "h:1")
    assert auth.get(address_key("job", 1, 1))["value"] == "h:1"  # type: ignore[index]


class LocalStore:
    """The table as an ElectionStore, in this process."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table

    async def grant(self, ttl_s: int) -> str:
        return self.table.grant(ttl_s)

    async def keepalive(self, lease: str) -> int:
        return self.table.keepalive(lease)

    async def get(self, key: str) -> dict[str, Any] | None:
        return self.table.get(key)

    async def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]]
    ) -> tuple[bool, int]:
        return self.table.txn(compare, success)


def _config(tmp_path: Path, k: int, addresses: list[str]) -> ServerConfig:
    host, port = addresses[k].rsplit(":", 1)
    return ServerConfig(
        host=host,
        port=int(port),
        consistency="asp",
        lease_ms=60_000,
        replicas=2,
        replica_index=k,
        replica_addresses=",".join(addresses),
        checkpoint_dir=str(tmp_path / f"replica-{k}" / "checkpoints"),
        wal=True,
        wal_dir=str(tmp_path / f"replica-{k}" / "wal"),
        election_prefix="job",
        election_ttl_s=1,
    )


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


async def _two_replicas(
    tmp_path: Path,
) -> tuple[LeaseTable, LocalStore, list[str], int, ParameterServerDaemon, ParameterServerDaemon]:
    """Two replica daemons of one shard electing through a lease table, replica 0 primary;
    also a free port for a replica placed again later."""
    table = LeaseTable()
    store = LocalStore(table)
    p0, p1, p2 = _free_ports(3)
    addresses = [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]
    d0 = ParameterServerDaemon(_config(tmp_path, 0, addresses), election_store=store)
    d1 = ParameterServerDaemon(_config(tmp_path, 1, addresses), election_store=store)
    await d0.start()
    try:
        await d1.start()
        await eventually(lambda: d0.replica is not None and d0.replica.primary is not None)
    except BaseException:
        await d1.stop(0.0)
        await d0.stop(0.0)
        raise
    return table, store, addresses, p2, d0, d1


async def _three_pushes_in_sync(ps: Any, primary: ParameterServerDaemon, g: np.ndarray) -> None:
    """Declare ``x`` (rule add), push ``g`` three times, and wait until both replicas are in
    sync at ``primary``."""
    await ps.init({"x": np.zeros(4, np.float32)}, rule=UpdateRule("add"))
    for _ in range(3):
        await ps.push({"x": g})
    await eventually(lambda: primary.replica.primary.in_sync() == {0, 1})  # type: ignore[union-attr]


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_replicas_fail_over_and_reseed_a_moved_backup_through_the_table(
    tmp_path: Path,
) -> None:
    """Replica 0 is elected first; the pushes it acknowledges are on replica 1 when replica 0
    stops (its lease lapses: no graceful hand-over); replica 1 is promoted under a higher
    epoch and serves; a new replica 0 at another address publishes it and is seeded by the new
    primary; every acknowledged push is in the final value, applied once."""
    table, store, addresses, p2, d0, d1 = await _two_replicas(tmp_path)
    moved: ParameterServerDaemon | None = None
    try:
        assert d0.replica is not None and d1.replica is not None
        epoch0 = d0.replica.epoch
        retry = RetryPolicy(deadline_s=scaled(30.0))
        g = np.arange(4, dtype=np.float32)
        async with connect("|".join(addresses), "w", retry=retry) as ps:
            await _three_pushes_in_sync(ps, d0, g)
            # replica 0 is lost: it stops serving and renewing (no hand-over, no release)
            await d0.stop(0.0)
            await eventually(lambda: d1.replica.primary is not None, timeout_s=20.0)  # type: ignore[union-attr]
            assert d1.replica.epoch > epoch0
            for _ in range(2):
                await ps.push({"x": g})
            # replica 0 again, at another address (as on another node), with an empty disk
            moved_addresses = [f"127.0.0.1:{p2}", addresses[1]]
            table.txn([], [Etcd.put(address_key("job", 0, 0), moved_addresses[0])])
            cfg = _config(tmp_path / "new-node", 0, moved_addresses)
            moved = ParameterServerDaemon(cfg, election_store=store)
            await moved.start()
            await eventually(
                lambda: d1.replica.primary.in_sync() == {0, 1},  # type: ignore[union-attr]
                timeout_s=30.0,
            )
            await ps.push({"x": g})
            values = await ps.pull(["x"])
        np.testing.assert_array_equal(values["x"], 6 * g)
        assert d1.engine is not None and d1.engine.core.applied_updates == 6
        assert moved.engine is not None
        await eventually(lambda: moved.engine.core.applied_updates == 6)  # type: ignore[union-attr]
        assert moved.replica is not None and moved.replica.primary is None
    finally:
        for d in (d0, d1, moved):
            if d is not None:
                await d.stop(0.0)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_client_follows_a_moved_replica_through_a_second_failover(
    tmp_path: Path,
) -> None:
    """Replica 0 is lost and placed again at another address; the primary (replica 1) names
    the new address in its heartbeat answers and the client reconnects to it, and the shard
    map it serves names it too (a client that opens only now, with the first addresses,
    finds it there); then replica 1 is lost too, the moved replica 0 is promoted, and both
    clients' pushes reach it. Every acknowledged push is in the final value, applied once
    (the sum counted here)."""
    table, store, addresses, p2, d0, d1 = await _two_replicas(tmp_path)
    moved: ParameterServerDaemon | None = None
    try:
        assert d0.replica is not None and d1.replica is not None
        retry = RetryPolicy(deadline_s=scaled(30.0))
        g = np.arange(4, dtype=np.float32)
        async with connect("|".join(addresses), "w", retry=retry, heartbeat=False) as ps:
            await ps.init({"x": np.zeros(4, np.float32)}, rule=UpdateRule("add"))
            await ps.push({"x": g})
            await eventually(lambda: d0.replica.primary.in_sync() == {0, 1})  # type: ignore[union-attr]
            await d0.stop(0.0)  # replica 0 lost; replica 1 promoted
            await eventually(lambda: d1.replica.primary is not None, timeout_s=20.0)  # type: ignore[union-attr]
            await ps.push({"x": g})
            moved_address = f"127.0.0.1:{p2}"
            table.txn([], [Etcd.put(address_key("job", 0, 0), moved_address)])
            moved = ParameterServerDaemon(
                _config(tmp_path / "new-node", 0, [moved_address, addresses[1]]),
                election_store=store,
            )
            await moved.start()
            await eventually(
                lambda: d1.replica.primary.in_sync() == {0, 1},  # type: ignore[union-attr]
                timeout_s=30.0,
            )
            answer = await ps.heartbeat()
            assert list(answer.replicas) == [moved_address, addresses[1]]
            # the client now addresses the replicas where they are
            assert set(ps._api.address.split("|")) == {moved_address, addresses[1]}  # type: ignore[union-attr]
            await ps.push({"x": g})
            # and a worker that starts only now (a retried task) with the first addresses
            # discovers the moved one in the shard map the shard serves
            await eventually(
                lambda: (
                    d1.shard_map is not None
                    and d1.shard_map.addresses == (f"{moved_address}|{addresses[1]}",)
                ),
                timeout_s=10.0,
            )
            late = connect("|".join(addresses), "late", retry=retry, heartbeat=False)
            await late.__aenter__()
            await late.push({"x": g})
            await d1.stop(0.0)  # replica 1 lost as well; the moved replica 0 is promoted
            await eventually(
                lambda: moved.replica is not None and moved.replica.primary is not None,  # type: ignore[union-attr]
                timeout_s=20.0,
            )
            await ps.push({"x": g})
            await late.push({"x": g})
            await late.__aexit__(None, None, None)
            values = await ps.pull(["x"])
        np.testing.assert_array_equal(values["x"], 6 * g)
        assert moved.engine is not None and moved.engine.core.applied_updates == 6
    finally:
        for d in (d0, d1, moved):
            if d is not None:
                await d.stop(0.0)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_replica_placed_again_with_an_empty_disk_is_not_elected(
    tmp_path: Path,
) -> None:
    """Both replicas are in sync when the primary (replica 0) is lost, and replica 0 is
    placed again at another address with an empty disk before replica 1 campaigns (its
    election is held back here; on Ray the new replica can start within the lease's lapse).
    The in-sync set recorded before the loss still names index 0, but the new replica 0 holds
    none of the shard's state: it must not be elected (elected, it would serve an empty
    shard). Replica 1 then campaigns, is elected, seeds the new replica 0, and every
    acknowledged push is in the value, applied once."""
    table, store, addresses, p2, d0, d1 = await _two_replicas(tmp_path)
    empty: ParameterServerDaemon | None = None
    try:
        assert d0.replica is not None and d1.replica is not None
        retry = RetryPolicy(deadline_s=scaled(60.0))
        g = np.arange(4, dtype=np.float32)
        async with connect("|".join(addresses), "w", retry=retry) as ps:
            await _three_pushes_in_sync(ps, d0, g)
        assert d1.election is not None
        await d1.election.stop()  # replica 1 stays a backup and does not campaign, for now
        await d0.stop(0.0)  # the primary's node is lost, disk and all
        moved_addresses = [f"127.0.0.1:{p2}", addresses[1]]
        table.txn([], [Etcd.put(address_key("job", 0, 0), moved_addresses[0])])
        empty = ParameterServerDaemon(
            _config(tmp_path / "new-node", 0, moved_addresses), election_store=store
        )
        await empty.start()
        assert empty.replica is not None and not empty.replica.holds_state
        # well past the lapse of replica 0's lease (ttl 1 s) and many campaign polls
        for _ in range(40):
            assert empty.replica.primary is None, "an empty replica was elected"
            await asyncio.sleep(0.1)
        assert table.get("job/shard-0/primary") is None
        assert d1.replica.holds_state  # a primary streamed to it (it restored nothing)
        await d1.election.start()
        await eventually(lambda: d1.replica.primary is not None, timeout_s=20.0)  # type: ignore[union-attr]
        await eventually(
            lambda: d1.replica.primary.in_sync() == {0, 1},  # type: ignore[union-attr]
            timeout_s=30.0,
        )
        assert empty.replica.primary is None and empty.replica.holds_state
        async with connect("|".join(moved_addresses), "w2", retry=retry) as ps:
            await ps.push({"x": g})
            values = await ps.pull(["x"])
        np.testing.assert_array_equal(values["x"], 4 * g)
        await eventually(lambda: empty.engine.core.applied_updates == 4)
    finally:
        for d in (d0, d1, empty):
            if d is not None:
                await d.stop(0.0)
