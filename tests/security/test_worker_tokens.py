"""Per-worker tokens (issue 19, item 7; docs/security.md): a token bound to a worker name may
only make calls naming that worker — push, clock, leave, heartbeat, pull, register (replace
too) — on gRPC, the Session and the local link; role-only tokens act as any worker."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import PermissionDenied
from paramserver.security.tls import ClientSecurity, open_channel
from paramserver.security.tokens import TokenTable
from paramserver.worker_client import UpdateRule, connect
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


def _tokens(tmp_path: Path) -> tuple[str, dict[str, str]]:
    tok = {k: secrets.token_urlsafe(24) for k in ("alice", "bob", "any")}
    path = tmp_path / "tokens"
    path.write_text(
        f"worker {tok['alice']} alice\nworker {tok['bob']} bob\nworker {tok['any']}  # role only\n"
    )
    os.chmod(path, 0o600)
    return str(path), tok


def test_the_token_file_binds_worker_names() -> None:
    table = TokenTable.parse("worker " + "a" * 20 + " alice\nadmin " + "b" * 20 + "\n")
    assert table.worker_name_of("a" * 20) == "alice"
    assert table.worker_name_of("b" * 20) is None
    with pytest.raises(Exception, match="only worker tokens"):
        TokenTable.parse("admin " + "c" * 20 + " alice\n")


@pytest.mark.parametrize("fast_path", [False, True], ids=["grpc", "session-and-link"])
async def test_a_bound_token_acts_only_as_its_worker(tmp_path: Path, fast_path: bool) -> None:
    path, tok = _tokens(tmp_path)
    paths = {} if fast_path else {"session": False, "local_link": False}
    async with running_server(consistency="asp", auth_tokens=path, lease_ms=60_000) as srv:
        address = f"127.0.0.1:{srv.port}"
        as_alice = ClientSecurity(token=tok["alice"])
        async with connect(address, "alice", security=as_alice, heartbeat=False, **paths) as a:
            await a.init({"w": np.zeros(2, np.float32)}, rule=UpdateRule("add"))
            await a.push({"w": np.ones(2, np.float32)})  # its own name: served
            await a.clock()
            await a.heartbeat()
            np.testing.assert_array_equal((await a.pull(["w"]))["w"], np.ones(2, np.float32))
            with pytest.raises(PermissionDenied, match="bound to worker 'alice'"):
                await connect(address, "bob", security=as_alice, heartbeat=False).open()
            as_bob = ClientSecurity(token=tok["bob"])
            async with connect(address, "bob", security=as_bob, heartbeat=False, **paths) as b:
                bob_id, alice_id = b.worker_id, a.worker_id
                a.worker_id = bob_id  # alice's token, bob's worker id: every call refused
                try:
                    with pytest.raises(PermissionDenied):
                        await a.push({"w": np.ones(2, np.float32)})
                    with pytest.raises(PermissionDenied):
                        await a.clock()
                    with pytest.raises(PermissionDenied):
                        await a.heartbeat()
                finally:
                    a.worker_id = alice_id
                async with open_channel(address, as_alice) as channel:
                    stub = pb_grpc.ParameterServerStub(channel)
                    for call in (
                        stub.Leave(pb.LeaveRequest(worker_id=bob_id), timeout=10),
                        stub.Heartbeat(pb.HeartbeatRequest(worker_id=bob_id), timeout=10),
                        stub.Register(
                            pb.RegisterRequest(worker_name="bob", replace=True), timeout=10
                        ),
                    ):
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            await call
                        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                status = await b.status()
                live = {w.worker_name: w.worker_id for w in status.workers if w.live}
                assert live["bob"] == bob_id  # never fenced, never made to leave
                np.testing.assert_array_equal((await b.pull(["w"]))["w"], np.ones(2, np.float32))


async def test_a_role_only_token_may_act_as_any_worker(tmp_path: Path) -> None:
    path, tok = _tokens(tmp_path)
    async with running_server(consistency="asp", auth_tokens=path) as srv:
        anyone = ClientSecurity(token=tok["any"])
        for name in ("alice", "carol"):
            async with connect(f"127.0.0.1:{srv.port}", name, security=anyone) as ps:
                await ps.heartbeat()


async def test_the_reduction_server_enforces_the_binding_too(tmp_path: Path) -> None:
    """``serve --mode reduce``: a token bound to alice registers, heartbeats and leaves only as
    alice (the parameter server's rule on the reduction service's calls)."""
    from paramserver.api.v1 import reduction_pb2 as rpb
    from paramserver.api.v1 import reduction_pb2_grpc as rpb_grpc

    path, tok = _tokens(tmp_path)
    async with running_server(mode="reduce", auth_tokens=path, lease_ms=60_000) as srv:
        address = f"127.0.0.1:{srv.port}"
        alice = open_channel(address, ClientSecurity(token=tok["alice"]))
        bob = open_channel(address, ClientSecurity(token=tok["bob"]))
        try:
            as_alice, as_bob = (
                rpb_grpc.ReductionServiceStub(alice),
                rpb_grpc.ReductionServiceStub(bob),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await as_alice.Register(rpb.ReductionRegisterRequest(worker_name="bob"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            a = await as_alice.Register(
                rpb.ReductionRegisterRequest(worker_name="alice"), timeout=10
            )
            b = await as_bob.Register(rpb.ReductionRegisterRequest(worker_name="bob"), timeout=10)
            for call in (
                as_alice.Heartbeat(
                    rpb.ReductionHeartbeatRequest(worker_id=b.worker_id), timeout=10
                ),
                as_alice.Leave(rpb.ReductionLeaveRequest(worker_id=b.worker_id), timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await as_alice.Heartbeat(
                rpb.ReductionHeartbeatRequest(worker_id=a.worker_id), timeout=10
            )
            await as_bob.Leave(rpb.ReductionLeaveRequest(worker_id=b.worker_id), timeout=10)
        finally:
            await alice.close()
            await bob.close()
