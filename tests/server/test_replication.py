"""Shard replicas in one process: the primary streams its log, a backup copies it durably.

Two real daemons on 127.0.0.1 (replica 0 is primary at epoch 1: no election), a real worker
client at the primary. Expected values are computed here with numpy, independently of the
server: the sum of every pushed gradient under the ``add`` rule.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from paramserver.cli.demos.local_cluster import free_ports
from paramserver.core.optimizers import UpdateRule
from paramserver.errors import NotPrimary
from paramserver.server.config import ServerConfig
from paramserver.server.shard_daemon import ParameterServerDaemon
from paramserver.server.wal import WriteAheadLog
from paramserver.worker_client.client import WorkerClient
from tests.harness.polling import eventually

pytestmark = pytest.mark.timeout(120)


def _config(tmp: Path, index: int, ports: list[int]) -> ServerConfig:
    return ServerConfig(
        port=ports[index],
        consistency="asp",
        checkpoint_dir=str(tmp / f"replica-{index}"),
        wal=True,
        shared_memory=False,
        replicas=2,
        replica_index=index,
        replica_addresses=",".join(f"127.0.0.1:{p}" for p in ports),
        grace_s=0.5,
    )


def _value(daemon: ParameterServerDaemon, key: str) -> np.ndarray:
    assert daemon.engine is not None
    return np.array(daemon.engine.core.store.get(key).value)


async def test_backup_holds_every_acknowledged_push(tmp_path: Path) -> None:
    ports = free_ports(2)
    primary = ParameterServerDaemon(_config(tmp_path, 0, ports))
    backup = ParameterServerDaemon(_config(tmp_path, 1, ports))
    await backup.start()
    await primary.start()
    try:
        assert primary.replica is not None and primary.replica.primary is not None
        link = primary.replica.primary.links[1]
        await eventually(lambda: link.in_sync, timeout_s=10, what="the backup in sync")
        rng = np.random.default_rng(7)
        grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(20)]
        async with WorkerClient(primary.address, "w0") as ps:
            await ps.init({"w": np.zeros(1000, np.float32)}, rule=UpdateRule("add"))
            for g in grads:
                await ps.push({"w": g})
            # Acknowledged means durable at the backup too: no waiting needed here.
            assert backup.engine is not None and backup.engine.wal is not None
            assert backup.replica is not None
            expected = np.sum(np.stack(grads, dtype=np.float64), axis=0)
            np.testing.assert_allclose(_value(backup, "w"), expected, rtol=1e-5, atol=1e-5)
            assert _value(backup, "w").tobytes() == _value(primary, "w").tobytes()
            # The backup's own log holds the primary's records with the same sequences.
            assert primary.engine is not None and primary.engine.wal is not None
            seqs = [
                r.sequence for r in WriteAheadLog(Path(tmp_path / "replica-1" / "wal")).replay()
            ]
            assert seqs and seqs[-1] == primary.engine.wal.next_sequence - 1
            # A backup serves no client: a worker there is refused (UNAVAILABLE, retryable).
            with pytest.raises(NotPrimary):
                backup.engine.check_serving()
    finally:
        await primary.stop(0.2)
        await backup.stop(0.2)


async def test_lost_backup_is_reseeded_while_training_goes_on(tmp_path: Path) -> None:
    ports = free_ports(2)
    primary = ParameterServerDaemon(_config(tmp_path, 0, ports))
    backup = ParameterServerDaemon(_config(tmp_path, 1, ports))
    await backup.start()
    await primary.start()
    try:
        assert primary.replica is not None and primary.replica.primary is not None
        role = primary.replica.primary
        link = role.links[1]
        await eventually(lambda: link.in_sync, timeout_s=10, what="the backup in sync")
        total = np.zeros(64, np.float64)
        async with WorkerClient(primary.address, "w0") as ps:
            await ps.init({"w": np.zeros(64, np.float32)}, rule=UpdateRule("add"))
            for i in range(5):
                g = np.full(64, i + 1, np.float32)
                await ps.push({"w": g})
                total += g
            await backup.stop(0.1)  # the backup goes away: the primary goes on alone
            await eventually(lambda: not link.in_sync, timeout_s=10, what="backup out of sync")
            for i in range(5, 10):
                g = np.full(64, i + 1, np.float32)
                await ps.push({"w": g})
                total += g
            # A new backup process on the same port, its state directory deleted.
            shutil.rmtree(tmp_path / "replica-1")
            backup = ParameterServerDaemon(_config(tmp_path, 1, ports))
            await backup.start()
            await eventually(lambda: link.in_sync, timeout_s=20, what="the new backup seeded")
            for i in range(10, 12):
                g = np.full(64, i + 1, np.float32)
                await ps.push({"w": g})
                total += g
            np.testing.assert_array_equal(_value(backup, "w"), total.astype(np.float32))
            assert role.seeds_sent >= 2
    finally:
        await primary.stop(0.2)
        await backup.stop(0.2)


async def test_backup_refuses_an_older_epoch(tmp_path: Path) -> None:
    ports = free_ports(2)
    primary = ParameterServerDaemon(_config(tmp_path, 0, ports))
    backup = ParameterServerDaemon(_config(tmp_path, 1, ports))
    await backup.start()
    assert backup.replica is not None
    backup.replica.backup.observe_epoch(5)  # a newer primary was elected meanwhile
    await primary.start()
    try:
        assert primary.replica is not None
        await eventually(
            lambda: primary.replica is not None and primary.replica.primary is None,
            timeout_s=10,
            what="the epoch-1 primary deposed",
        )
        assert primary.engine is not None
        with pytest.raises(NotPrimary, match="epoch 5"):
            primary.engine.check_serving()
    finally:
        await primary.stop(0.2)
        await backup.stop(0.2)


async def test_replicas_stream_with_the_shared_admin_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("worker worker-token-0123456789abcdef\nadmin admin-token-0123456789abcdef\n")
    ports = free_ports(2)
    configs = [_config(tmp_path, i, ports).replace(auth_tokens=str(tokens)) for i in range(2)]
    primary = ParameterServerDaemon(configs[0])
    backup = ParameterServerDaemon(configs[1])
    await backup.start()
    await primary.start()
    try:
        assert primary.replica is not None and primary.replica.primary is not None
        link = primary.replica.primary.links[1]
        await eventually(lambda: link.in_sync, timeout_s=10, what="the backup in sync")
    finally:
        await primary.stop(0.2)
        await backup.stop(0.2)
