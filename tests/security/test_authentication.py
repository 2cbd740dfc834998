"""TLS, mutual TLS and bearer-token authentication over real gRPC on 127.0.0.1 (issue #8 item 1).

Certificates are generated here (``tls_helpers``: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate of the same CA and one of another CA). Every RPC of a service is
called generically from its descriptor (empty request messages), so an RPC added to a proto is
covered without touching this file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import ServiceDescriptor

from paramserver.api.v1 import (
    parameter_server_pb2,
    reduction_pb2,
    reduction_pb2_grpc,
    spmd_pb2,
    spmd_pb2_grpc,
    tensor_pb2,
)
from paramserver.cli.health import check_health
from paramserver.errors import MalformedStream, PermissionDenied, Unauthenticated
from paramserver.reduction.gossip_worker import GossipWorker
from paramserver.reduction.reduce_client import connect_reduction
from paramserver.security.tls import ClientSecurity, ServerSecurity, open_channel, peer_security
from paramserver.spmd import RankFailures, RemoteLayout, SpmdParallelWorkers, Tier
from paramserver.spmd.layout import Layout
from paramserver.spmd.rank_client import RankClient
from paramserver.spmd.rank_server import RankServerConfig, start_rank_server
from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess, running_cluster, running_server
from tests.harness.pki import Pki, Tokens, make_pki, make_tokens

pytestmark = pytest.mark.timeout(60)

PS = parameter_server_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
REDUCE = reduction_pb2.DESCRIPTOR.services_by_name["ReductionService"]
RANK = spmd_pb2.DESCRIPTOR.services_by_name["RankServer"]
ADMIN_PS = {"Checkpoint"}
ADMIN_RANK = {"ImportMetadata", "ForgetRemote"}
LAYOUT = Layout(0, num_layers=2, outer_dim=2, page_size=4, inner_dim=32)  # 1 KiB blocks


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return make_tokens(tmp_path_factory.mktemp("tokens"))


def mtls(pki: Pki, token: str | None = None) -> ClientSecurity:
    return ClientSecurity(
        tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key, token=token
    )


def server_tls(pki: Pki, tokens: Tokens | None = None, *, mutual: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {"tls_cert": pki.server_cert, "tls_key": pki.server_key}
    if mutual:
        cfg["tls_ca"] = pki.ca
    if tokens is not None:
        cfg["auth_tokens"] = tokens.path
    return cfg


async def call_every_method(
    address: str, service: ServiceDescriptor, security: ClientSecurity | None
) -> dict[str, grpc.StatusCode]:
    """Call every RPC of ``service`` once with an empty request; the status code of each.

    Each call's deadline is 20 s: a refusal answers at once, but the first call of a fresh
    channel also waits for its TLS handshake, which a heavily loaded 2-core machine can stretch
    past a short deadline (DEADLINE_EXCEEDED instead of the code under test)."""
    codes: dict[str, grpc.StatusCode] = {}
    async with open_channel(address, security) as channel:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            kind = (
                "stream" if method.client_streaming else "unary",
                "stream" if method.server_streaming else "unary",
            )
            make = getattr(channel, f"{kind[0]}_{kind[1]}")
            call = make(path, request_serializer=bytes, response_deserializer=bytes)
            # A client stream sends no message: the refusal is decided on the call's metadata,
            # and a request still being written when the server aborts races its status (grpc
            # can then report INTERNAL instead of the code the server sent).
            request: Any = iter([]) if method.client_streaming else b""
            try:
                if method.server_streaming:
                    async for _ in call(request, timeout=20):
                        pass
                else:
                    await call(request, timeout=20)
                codes[method.name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as err:
                codes[method.name] = err.code()
    return codes


async def status_code(address: str, security: ClientSecurity | None) -> grpc.StatusCode:
    """The code of one Status call (OK, or why it failed)."""
    codes = await call_every_method(address, _only(PS, "Status"), security)
    return codes["Status"]


def _only(service: ServiceDescriptor, name: str) -> Any:
    class One:
        full_name = service.full_name
        methods = [service.methods_by_name[name]]

    return One


# --------------------------------------------------------------------------- TLS and mTLS
async def test_tls_handshake_works_and_plaintext_or_untrusted_clients_are_refused(
    pki: Pki,
) -> None:
    async with running_server(**server_tls(pki, mutual=False), consistency="asp") as srv:
        async with connect(srv.address, "w0", security=ClientSecurity(tls_ca=pki.ca)) as ps:
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            await ps.init({"w": np.zeros_like(x)}, rule=UpdateRule("add"))
            await ps.push({"w": x})
            got = await ps.pull(["w"])
            np.testing.assert_array_equal(got["w"], x)  # 0 + x, bit-exact
        # plain text against a TLS port, and TLS that does not trust the server's CA
        assert await status_code(srv.address, None) == grpc.StatusCode.UNAVAILABLE
        other = ClientSecurity(tls_ca=pki.other_ca)
        assert await status_code(srv.address, other) == grpc.StatusCode.UNAVAILABLE
        # the certificate names 127.0.0.1 and localhost, not other names
        misnamed = ClientSecurity(tls_ca=pki.ca, tls_server_name="elsewhere.example")
        assert await status_code(srv.address, misnamed) == grpc.StatusCode.UNAVAILABLE
        assert await status_code(srv.address, ClientSecurity(tls_ca=pki.ca)) == grpc.StatusCode.OK


async def test_mutual_tls_refuses_clients_without_a_certificate_or_from_another_ca(
    pki: Pki,
) -> None:
    async with running_server(**server_tls(pki)) as srv:
        assert srv.security is not None and srv.security.mutual_tls
        assert await status_code(srv.address, mtls(pki)) == grpc.StatusCode.OK
        no_cert = ClientSecurity(tls_ca=pki.ca)
        assert await status_code(srv.address, no_cert) == grpc.StatusCode.UNAVAILABLE
        stranger = ClientSecurity(
            tls_ca=pki.ca, tls_cert=pki.other_client_cert, tls_key=pki.other_client_key
        )
        assert await status_code(srv.address, stranger) == grpc.StatusCode.UNAVAILABLE
        assert await status_code(srv.address, None) == grpc.StatusCode.UNAVAILABLE
        # health stays open without a token, but still needs the handshake
        assert await check_health(srv.address, security=mtls(pki)) == "SERVING"


# --------------------------------------------------------------------------- tokens
async def test_every_ps_rpc_is_refused_without_a_token_or_with_a_wrong_one(
    pki: Pki, tokens: Tokens
) -> None:
    async with running_server(**server_tls(pki, tokens)) as srv:
        for security in (mtls(pki), mtls(pki, "w" * 32), mtls(pki, tokens.worker + "x")):
            codes = await call_every_method(srv.address, PS, security)
            assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED), codes
            assert set(codes) == {m.name for m in PS.methods}
        # nothing reached the handlers: no worker registered, no key declared
        async with connect(srv.address, "probe", security=mtls(pki, tokens.admin)) as ps:
            status = await ps.status()
            assert status.view.live_workers == 1  # the probe itself
            assert list(status.keys) == []


async def test_worker_token_refused_on_admin_rpcs_and_admin_token_accepted(
    pki: Pki, tokens: Tokens, tmp_path: Path
) -> None:
    config = server_tls(pki, tokens) | {"checkpoint_dir": str(tmp_path / "ckpt")}
    async with running_server(**config) as srv:
        worker = await call_every_method(srv.address, PS, mtls(pki, tokens.worker))
        refused = {m for m, code in worker.items() if code == grpc.StatusCode.PERMISSION_DENIED}
        assert refused == ADMIN_PS
        # worker RPCs reached their handlers (empty requests get the handlers' own answers)
        assert grpc.StatusCode.UNAUTHENTICATED not in worker.values()
        admin = await call_every_method(
            srv.address, _only(PS, "Checkpoint"), mtls(pki, tokens.admin)
        )
        assert admin == {"Checkpoint": grpc.StatusCode.OK}
        assert any((tmp_path / "ckpt").iterdir())  # the admin's checkpoint was written
        # the worker client: a worker token trains; the admin role implies worker
        for token in (tokens.worker, tokens.admin):
            async with connect(srv.address, f"w-{token[:4]}", security=mtls(pki, token)) as ps:
                await ps.init({"b": np.ones(3)}, rule=UpdateRule("assign"))
                np.testing.assert_array_equal((await ps.pull(["b"]))["b"], np.ones(3))


async def test_tokens_on_a_plaintext_loopback_server_and_client_errors(tokens: Tokens) -> None:
    async with running_server(auth_tokens=tokens.path, consistency="asp") as srv:
        assert srv.security is not None and not srv.security.tls
        good = ClientSecurity(token=tokens.worker)
        async with connect(srv.address, "w0", security=good) as ps:
            g = np.array([1.5, -2.0, 0.25])
            await ps.init({"v": np.zeros(3)}, rule=UpdateRule("add"))  # client-streaming
            for _ in range(3):
                await ps.push({"v": g})
            np.testing.assert_array_equal((await ps.pull(["v"]))["v"], 3 * g)  # server-streaming
        with pytest.raises(Unauthenticated, match="missing bearer token"):
            async with connect(srv.address, "w1", rpc_timeout_s=5):
                pass
        with pytest.raises(Unauthenticated, match="unknown bearer token"):
            async with connect(srv.address, "w1", security=ClientSecurity(token="z" * 20)):
                pass
        codes = await call_every_method(srv.address, PS, None)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}


async def test_refusals_are_logged_with_method_and_peer_never_the_token(
    tokens: Tokens, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "s3cret-but-wrong-" + tokens.worker[:8]
    async with running_server(auth_tokens=tokens.path) as srv:
        with caplog.at_level(logging.WARNING, logger="paramserver.security.tokens"):
            await call_every_method(srv.address, _only(PS, "Pull"), ClientSecurity(token=wrong))
            await call_every_method(
                srv.address, _only(PS, "Checkpoint"), ClientSecurity(token=tokens.worker)
            )
    records = [r.getMessage() for r in caplog.records if r.name == "paramserver.security.tokens"]
    assert len(records) == 2, records
    assert "/paramserver.api.v1.ParameterServer/Pull" in records[0]
    assert "UNAUTHENTICATED" in records[0] and "127.0.0.1" in records[0]
    assert "PERMISSION_DENIED" in records[1] and "Checkpoint" in records[1]
    for text in records:
        assert wrong not in text and tokens.worker not in text and tokens.admin not in text


# --------------------------------------------------------------------------- other servers
async def test_reduction_service_with_mutual_tls_and_tokens(pki: Pki, tokens: Tokens) -> None:
    async with running_server(mode="reduce", **server_tls(pki, tokens)) as srv:
        codes = await call_every_method(srv.address, REDUCE, mtls(pki))
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        grads = [
            {"w": np.array([1.0, 2.0, 3.0], np.float32)},
            {"w": np.array([3.0, -2.0, 0.5], np.float32)},
        ]
        clients = [
            connect_reduction(srv.address, f"r{i}", security=mtls(pki, tokens.worker))
            for i in range(2)
        ]
        for c in clients:
            await c.open()
        try:
            out = await asyncio.gather(
                *(c.reduce(0, g, timeout_s=10) for c, g in zip(clients, grads, strict=True))
            )
        finally:
            for c in clients:
                await c.close()
        expected = (grads[0]["w"] + grads[1]["w"]) / 2  # mean over the two workers
        for result in out:
            np.testing.assert_allclose(result["w"], expected, rtol=0, atol=1e-7)


async def test_gossip_workers_average_over_mutual_tls_with_tokens(pki: Pki, tokens: Tokens) -> None:
    # the workers' own endpoints serve TLS with a certificate valid for 127.0.0.1
    sec = ClientSecurity(
        tls_ca=pki.ca, tls_cert=pki.server_cert, tls_key=pki.server_key, token=tokens.worker
    )
    values = [np.array([0.0, 4.0]), np.array([2.0, -2.0]), np.array([7.0, 1.0])]
    async with running_server(
        mode="reduce", reduce_strategy="gossip", fanout=1, **server_tls(pki, tokens)
    ) as srv:
        workers = [
            GossipWorker(srv.address, f"g{i}", v, seed=i, security=sec)
            for i, v in enumerate(values)
        ]
        try:
            for w in workers:
                await w.open()
            assert workers[0].endpoint_security is not None
            assert workers[0].endpoint_security.mutual_tls
            # a peer endpoint refuses a caller without the token (mutual TLS alone is not enough)
            async with open_channel(workers[0].endpoint, mtls(pki)) as ch:
                call = ch.stream_unary(
                    "/paramserver.api.v1.PushSumPeer/PushShare",
                    request_serializer=bytes,
                    response_deserializer=bytes,
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(iter([b""]), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            delivered = 0
            for _ in range(8):
                for w in workers:
                    delivered += await w.run_round()
            assert delivered > 0
            assert sum(w.received_shares for w in workers) == delivered
            # push-sum conserves mass: sum of s over sum of w is the exact mean
            s_total = sum(w.node.s for w in workers if w.node is not None)
            w_total = sum(w.node.w for w in workers if w.node is not None)
            np.testing.assert_allclose(s_total / w_total, np.mean(values, axis=0), atol=1e-12)
        finally:
            for w in workers:
                await w.close()


async def test_rank_servers_with_mutual_tls_and_tokens(
    pki: Pki, tokens: Tokens, tmp_path: Path
) -> None:
    server = ServerSecurity(
        tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca, auth_tokens=tokens.path
    )
    handles = []
    for instance in ("A", "B"):
        cfg = RankServerConfig(
            instance_id=instance,
            rank=0,
            layout=LAYOUT,
            host_blocks=8,
            disk_blocks=0,
            disk_dir=tmp_path / instance,
            object_dir=None,
            security=server,
            peer_security=peer_security(server, tokens.worker),
        )
        handles.append(await start_rank_server(cfg))
    a_addr, b_addr = ([h.address.replace("localhost", "127.0.0.1")] for h in handles)
    try:
        codes = await call_every_method(b_addr[0], RANK, mtls(pki))
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        worker = await call_every_method(b_addr[0], RANK, mtls(pki, tokens.worker))
        denied = {m for m, c in worker.items() if c == grpc.StatusCode.PERMISSION_DENIED}
        assert denied == ADMIN_RANK
        data = np.random.default_rng(8).integers(0, 256, (3, LAYOUT.bytes_per_block), np.uint8)
        async with (
            SpmdParallelWorkers(a_addr, security=mtls(pki, tokens.admin)) as a,
            SpmdParallelWorkers(b_addr, security=mtls(pki, tokens.worker)) as b_worker,
            SpmdParallelWorkers(b_addr, security=mtls(pki, tokens.admin)) as b,
        ):
            await a.write_blocks(0, Tier.G2, [0, 1, 2], data)
            with pytest.raises(RankFailures) as denied:  # connecting instances is admin
                await b_worker.connect_remote("A", await a.export_metadata())
            assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert isinstance(denied.value.failures[0], PermissionDenied)
            assert not b_worker.has_remote_metadata("A")
            await b.connect_remote("A", await a.export_metadata())
            # B's rank server reads A's blocks over its own mutual-TLS channel, presenting its
            # (worker) peer token to A
            done = await (
                await b.execute_remote_onboard(
                    RemoteLayout("A", Tier.G2, [0, 1, 2]),
                    Tier.G2,
                    [5, 6, 7],
                    allow_shared_memory=False,
                )
            )
            assert {r.path for r in done.results.values()} == {"grpc"}
            got = await b_worker.read_blocks(0, Tier.G2, [5, 6, 7])
            np.testing.assert_array_equal(
                np.ascontiguousarray(got).view(np.uint8).reshape(3, -1), data
            )
    finally:
        for h in handles:
            await h.stop(0.2)


# --------------------------------------------------------------------------- real processes
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSERVER_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "paramserver", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
    )


@pytest.fixture
def secure_server(pki: Pki, tokens: Tokens, tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tmp_path,
        "--consistency",
        "asp",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--tls-cert",
        pki.server_cert,
        "--tls-key",
        pki.server_key,
        "--tls-ca",
        pki.ca,
        "--auth-tokens",
        tokens.path,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)  # about ten CLI processes: minutes on a busy machine
def test_cli_serve_worker_status_checkpoint_health_end_to_end(
    secure_server: ServerProcess, pki: Pki, tokens: Tokens
) -> None:
    address = secure_server.address
    tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]
    worker = _cli(
        "worker",
        "--server",
        address,
        "--worker-index",
        "0",
        "--num-workers",
        "1",
        "--epochs",
        "1",
        "--no-eval",
        "--min-accuracy",
        "0",
        "--log-format",
        "json",  # progress as JSON lines too
        *tls,
        "--token-file",
        tokens.worker_file,
    )
    assert worker.returncode == 0, worker.stderr[-2000:]
    done = json.loads(worker.stdout.strip().splitlines()[-1])
    assert done["event"] == "done" and done["steps"] > 0
    # the same through PARAMSERVER_* variables: status with the worker token from the env
    env = {
        "PARAMSERVER_TLS_CA": pki.ca,
        "PARAMSERVER_TLS_CERT": pki.client_cert,
        "PARAMSERVER_TLS_KEY": pki.client_key,
        "PARAMSERVER_TOKEN": tokens.worker,
    }
    status = _cli("status", "--server", address, env=env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip()
    denied = _cli("checkpoint", "--server", address, env=env)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr, denied.stderr
    ok = _cli("checkpoint", "--server", address, *tls, "--token-file", tokens.admin_file)
    assert ok.returncode == 0, ok.stderr
    assert Path(json.loads(ok.stdout)["path"]).is_dir()
    no_token = _cli("status", "--server", address, *tls)
    assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
    plain = _cli("status", "--server", address, "--timeout-s", "3")
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    health = _cli("health", "--server", address, *tls)  # open without a token
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    bad = _cli("status", "--server", address, "--tls-ca", str(Path(pki.ca).with_name("nope")))
    assert bad.returncode == 2 and "nope" in bad.stderr and "--tls-ca" in bad.stderr
    log = secure_server.log()
    assert "refused /paramserver.api.v1.ParameterServer/Checkpoint" in log
    assert tokens.worker not in log and tokens.admin not in log


# --------------------------------------------------------------------------- untrusted sizes
async def test_gossip_endpoint_refuses_a_share_claiming_more_than_its_value_before_allocating(
    tokens: Tokens,
) -> None:
    sec = ClientSecurity(token=tokens.worker)
    async with running_server(
        mode="reduce", reduce_strategy="gossip", auth_tokens=tokens.path
    ) as srv:
        async with GossipWorker(srv.address, "g0", np.zeros(4), security=sec) as node:
            huge = 1 << 40  # 1 TiB of float64, claimed by a 3-message stream
            frame = tensor_pb2.TensorFrame(
                header=tensor_pb2.TensorHeader(
                    key="s", dtype=tensor_pb2.DTYPE_FLOAT64, shape=[huge // 8], size_bytes=huge
                ),
                chunk_index=0,
                data=b"\0" * 8,
            )
            messages = [
                reduction_pb2.PushShareRequest(
                    header=reduction_pb2.PushShareHeader(
                        sender_id="x", receiver_id=node.worker_id, share_id=1
                    )
                ),
                reduction_pb2.PushShareRequest(frame=frame),
            ]
            async with open_channel(node.endpoint, sec) as ch:
                stub = reduction_pb2_grpc.PushSumPeerStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.PushShare(iter(messages), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds max_tensor_bytes 32" in (err.value.details() or "")
            assert node.received_shares == 0
            np.testing.assert_array_equal(node.estimate(), np.zeros(4))


async def test_push_claiming_more_than_its_key_is_refused_before_allocating() -> None:
    """A pushed tensor belongs to a declared key: a header claiming 1 TiB for a 4-element
    float32 key is refused (INVALID_ARGUMENT, before any allocation or back-pressure budget),
    an undeclared key is NOT_FOUND at its header, and the key is untouched."""
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0", heartbeat=False, session=False) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=UpdateRule("sgd", lr=1.0))
            huge = 1 << 40

            def push_of(key: str) -> list[parameter_server_pb2.PushRequest]:
                header = tensor_pb2.TensorHeader(
                    key=key, dtype=tensor_pb2.DTYPE_FLOAT32, shape=[huge // 4], size_bytes=huge
                )
                frame = tensor_pb2.TensorFrame(header=header, chunk_index=0, data=b"\0" * 16)
                return [
                    parameter_server_pb2.PushRequest(
                        header=parameter_server_pb2.PushHeader(
                            worker_id=ps.worker_id, request_id=77, clock=0
                        )
                    ),
                    parameter_server_pb2.PushRequest(frame=frame),
                ]

            for key, code, words in (
                ("w", grpc.StatusCode.INVALID_ARGUMENT, "claims 1099511627776 bytes"),
                ("nope", grpc.StatusCode.NOT_FOUND, "unknown key 'nope'"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ps.stub.Push(iter(push_of(key)), timeout=10)
                assert err.value.code() == code
                assert words in (err.value.details() or "")
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], np.zeros(4, np.float32))
            await ps.push({"w": np.ones(4, np.float32)})  # still serving
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], -np.ones(4, np.float32))


class _LyingRankServer(spmd_pb2_grpc.RankServerServicer):  # type: ignore[misc]
    """Announces a 32 TiB object and sends 5 bytes."""

    async def GetObject(self, request: Any, context: Any) -> Any:
        yield spmd_pb2.GetObjectResponse(info=spmd_pb2.ObjectInfo(size_bytes=1 << 45))
        yield spmd_pb2.GetObjectResponse(chunk=spmd_pb2.DataChunk(offset_bytes=0, data=b"hello"))


async def test_rank_client_does_not_allocate_an_announced_object_size() -> None:
    server = grpc.aio.server()
    spmd_pb2_grpc.add_RankServerServicer_to_server(_LyingRankServer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with RankClient(f"127.0.0.1:{port}", 0) as client:
            with pytest.raises(MalformedStream, match="ended after 5 of 35184372088832 bytes"):
                await client.get_object(7, timeout_s=5)
    finally:
        await server.stop(0)


async def test_sharded_cluster_over_mutual_tls_with_tokens(pki: Pki, tokens: Tokens) -> None:
    """The shard map's every shard is reached with the client's TLS settings and token."""
    async with running_cluster(
        2, slice_bytes=64, consistency="asp", **server_tls(pki, tokens)
    ) as shards:
        async with connect(shards[1].address, "w0", security=mtls(pki, tokens.worker)) as ps:
            assert ps.sharded
            w = np.arange(40, dtype=np.float32)  # 160 B: sliced over both shards
            await ps.init({"w": np.zeros_like(w)}, rule=UpdateRule("add"))
            await ps.push({"w": w})
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], w)
        for shard in shards:
            codes = await call_every_method(shard.address, _only(PS, "GetShardMap"), mtls(pki))
            assert codes == {"GetShardMap": grpc.StatusCode.UNAUTHENTICATED}


async def test_the_local_link_ticket_only_reaches_an_authenticated_session(
    pki: Pki, tokens: Tokens
) -> None:
    """Behind mutual TLS and tokens, a same-host worker's Session still moves to the local
    link: its ticket came over the authenticated gRPC Session. A session refused by the token
    check never gets one (and the socket serves nothing without a ticket: test_local_link)."""
    async with running_server(**server_tls(pki, tokens), consistency="asp") as srv:
        assert srv.local_link is not None
        async with connect(srv.address, "w0", security=mtls(pki, tokens.worker)) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=UpdateRule("add"))
            got = await ps.push_pull({"w": np.ones(4, np.float32)})
            assert ps.fastpath is not None and ps.fastpath.on_local_link
        np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))
        with pytest.raises(Unauthenticated):
            async with connect(srv.address, "w1", security=mtls(pki, "not-a-token")) as ps:
                await ps.push({"w": np.ones(4, np.float32)})
        assert srv.local_link.links_opened == 1
