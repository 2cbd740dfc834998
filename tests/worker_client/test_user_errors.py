"""Mistakes a new user makes get a clear, prompt answer (found by trying the README)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from paramserver.cli.demos.local_cluster import free_ports
from paramserver.cli.main import main as cli_main
from paramserver.errors import TLS_MISMATCH_HINT, InvalidArgument, Unavailable, from_rpc_error
from paramserver.security.tls import ClientSecurity, ServerSecurity, peer_security
from paramserver.security.tokens import TokenTable
from paramserver.server.config import ServerConfig
from paramserver.server.shard_daemon import ParameterServerDaemon
from paramserver.serving.metrics import MetricsServer
from paramserver.spmd.rank_server import RankServerConfig, start_rank_server
from paramserver.worker_client import UpdateRule, connect, connect_sync
from tests.harness import ScriptProcess, ServerProcess, running_server
from tests.harness.pki import Pki, make_pki, make_tokens

pytestmark = pytest.mark.timeout(90)


async def test_empty_key_is_refused_at_once_not_after_the_retry_deadline() -> None:
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0") as ps:
            t0 = time.monotonic()
            with pytest.raises(InvalidArgument, match="non-empty"):
                await ps.init({"": np.zeros(2)})
            with pytest.raises(InvalidArgument, match="non-empty"):
                await ps.push({"": np.zeros(2)})
            assert time.monotonic() - t0 < 2.0


@pytest.mark.slow
def test_restart_without_wal_refuses_to_drop_acknowledged_records(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    server = ServerProcess(tmp_path, "--consistency", "asp", "--checkpoint-dir", str(ckpt), "--wal")
    with connect_sync(server.address, "a") as ps:
        ps.init({"v": np.zeros(4, np.float32)}, UpdateRule("add"))
        ps.push({"v": np.full(4, 3, np.float32)})
        server.stop(signal.SIGKILL)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "serve",
            "--port",
            "0",
            "--consistency",
            "asp",
            "--checkpoint-dir",
            str(ckpt),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--wal" in refused.stderr and "Traceback" not in refused.stderr
    again = ServerProcess(tmp_path, "--consistency", "asp", "--checkpoint-dir", str(ckpt), "--wal")
    try:
        with connect_sync(again.address, "b") as ps:
            np.testing.assert_array_equal(ps.pull(["v"])["v"], np.full(4, 3, np.float32))
    finally:
        again.stop()


@pytest.mark.slow
def test_sigterm_worker_leaves_so_its_name_is_free_at_once(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp", "--lease-ms", "30000")
    try:
        worker = ScriptProcess(
            tmp_path,
            "worker-0",
            ["-m", "paramserver", "worker", "--server", server.address, "--worker-index", "0",
             "--num-workers", "1", "--epochs", "1000", "--no-eval"],
        )  # fmt: skip
        with worker, connect_sync(server.address, "probe") as ps:
            deadline = time.monotonic() + 60
            while not any(w.live and w.worker_name == "worker-0" for w in ps.status().workers):
                assert time.monotonic() < deadline, "worker never registered"
                time.sleep(0.05)
            worker.signal(signal.SIGTERM)
            _, err = worker.communicate(timeout_s=30)
            assert worker.proc.returncode == 143, err
            assert "Traceback" not in err
            # the lease is 30 s, yet the name is free now: the worker left cleanly
            live = [w.worker_name for w in ps.status().workers if w.live]
            assert "worker-0" not in live
    finally:
        server.stop()


@pytest.mark.slow
def test_bind_failure_is_one_line(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "paramserver", "serve", "--port", str(server.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.stop()
    assert proc.returncode == 1
    assert "could not bind" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- one-line CLI errors (review 2)
_C_CORE_LINE = re.compile(r"^[EIWD]\d{4} ", re.MULTILINE)  # grpc C-core log lines


def _paramserver(
    *args: str, timeout_s: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "paramserver", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=None if env is None else {**os.environ, **env},
    )


def _one_clean_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The process's stderr, asserted to be a single line without traceback or grpc noise."""
    err = proc.stderr
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    assert not _C_CORE_LINE.search(err), err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.slow
def test_busy_or_clashing_ports_are_one_line(busy_port: int) -> None:
    where = f"127.0.0.1:{busy_port}"
    for cmd in (
        ("serve", "--port", "0", "--metrics-port", str(busy_port)),
        ("serve", "--mode", "reduce", "--port", "0", "--metrics-port", str(busy_port)),
        ("rank-server", "--instance-id", "a", "--rank", "0", "--metrics-port", str(busy_port)),
    ):
        proc = _paramserver(*cmd)
        line = _one_clean_line(proc)
        assert proc.returncode == 1, line
        assert line.endswith(
            f": Unavailable (UNAVAILABLE): could not bind metrics port {where}: address in use"
        ), line
    for cmd in (("serve",), ("rank-server", "--instance-id", "a", "--rank", "0")):
        proc = _paramserver(*cmd, "--port", str(busy_port))
        line = _one_clean_line(proc)
        assert proc.returncode == 1 and f"could not bind {where}: address in use" in line, line
    clash = _paramserver("serve", "--port", str(busy_port), "--metrics-port", str(busy_port))
    line = _one_clean_line(clash)
    assert clash.returncode == 2 and "--metrics-port" in line and "--port" in line, line


async def test_a_failed_start_leaves_nothing_bound(busy_port: int) -> None:
    grpc_port = free_ports(1)[0]
    daemon = ParameterServerDaemon(
        ServerConfig(host="127.0.0.1", port=grpc_port, metrics_port=busy_port, consistency="asp")
    )
    with pytest.raises(Unavailable, match=f"metrics port 127.0.0.1:{busy_port}: address in use"):
        await daemon.start()
    with socket.socket() as probe:  # the gRPC port it had bound is free again
        probe.bind(("127.0.0.1", grpc_port))
    rank = RankServerConfig(
        instance_id="a", rank=0, port=grpc_port, metrics_port=busy_port, object_dir=None
    )
    with pytest.raises(Unavailable, match="metrics port"):
        await start_rank_server(rank)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", grpc_port))


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "127.0.0.1:99999"],
        ["status", "--server", "::1:50051"],
        ["checkpoint", "--server", "127.0.0.1:0"],
        ["health", "--server", "localhost"],
        ["worker", "--server", "127.0.0.1:70000", "--worker-index", "0", "--num-workers", "1"],
        ["cluster-check", "--server", "h:x", "--results-dir", "{tmp}", "--expect", "a"],
        ["spmd-demo", "--instance-a", "127.0.0.1:1", "--instance-b", "127.0.0.1:65536"],
        ["rank-server", "--instance-id", "a", "--rank", "0", "--address", "h:p"],
    ],
)
def test_malformed_addresses_are_refused_by_every_command(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    rc = cli_main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"paramserver {argv[0]}: InvalidArgument (INVALID_ARGUMENT): " in err
    assert "is not HOST:PORT" in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 5.0  # refused before any connection attempt


@pytest.mark.slow
def test_status_of_an_out_of_range_port_in_a_real_process_and_as_json() -> None:
    proc = _paramserver("status", "127.0.0.1:99999")
    line = _one_clean_line(proc)
    assert proc.returncode == 2 and "'127.0.0.1:99999' is not HOST:PORT" in line, line
    proc = _paramserver("--log-format", "json", "status", "127.0.0.1:99999")
    record = json.loads(_one_clean_line(proc))
    assert proc.returncode == 2
    assert (record["level"], record["error"], record["code"]) == (
        "ERROR",
        "InvalidArgument",
        "INVALID_ARGUMENT",
    )
    assert "127.0.0.1:99999" in record["message"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--plot", "curves.txt"], "--plot 'curves.txt': the file name must end in"),
        (["--staleness", "-1"], "--staleness must be >= 0, got -1"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    ],
)
def test_demo_refuses_bad_flags_before_starting_anything(
    flags: list[str], expected: str, tmp_path: Path
) -> None:
    if "--plot" in flags:
        pytest.importorskip("matplotlib")
    t0 = time.monotonic()
    # A fresh matplotlib config directory: its first run on a machine (as in CI) builds the
    # font cache and logs it; the one error line must still be all a user sees.
    proc = _paramserver("demo", *flags, env={"MPLCONFIGDIR": str(tmp_path)})
    line = _one_clean_line(proc)
    assert proc.returncode == 2 and expected in line, line
    assert "paramserver demo: server on" not in proc.stdout  # no server was started
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_demo_shows_why_a_worker_failed() -> None:
    # --min-accuracy above 1 cannot be met: every worker trains, then exits 1 saying so.
    proc = _paramserver(
        "demo", "--workers", "1", "--epochs", "1", "--min-accuracy", "1.01", timeout_s=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(
        r"worker 0 exited with code 1: .*paramserver worker: test accuracy 0\.\d{4} is below "
        r"--min-accuracy 1\.01",
        proc.stderr,
    ), proc.stderr


@pytest.mark.slow
def test_mismatched_tls_pair_is_refused_naming_both_files(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    proc = _paramserver(
        "serve", "--port", "0", "--tls-cert", pki.server_cert, "--tls-key", pki.client_key
    )
    line = _one_clean_line(proc)
    assert proc.returncode == 2, line
    assert f"--tls-key {pki.client_key!r} does not match --tls-cert {pki.server_cert!r}" in line


async def test_plaintext_client_of_a_tls_server_is_told_tls_may_be_the_reason(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path / "pki")
    tls = {"tls_cert": pki.server_cert, "tls_key": pki.server_key, "tls_ca": pki.ca}
    async with running_server(consistency="asp", **tls) as srv:
        async with grpc.aio.insecure_channel(srv.address) as channel:
            status = channel.unary_unary("/paramserver.api.v1.ParameterServer/Status")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await status(b"", timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert TLS_MISMATCH_HINT in from_rpc_error(raised.value).message
        # The same funnel on an address where nothing listens: no TLS hint.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_ports(1)[0]}") as channel:
            status = channel.unary_unary("/paramserver.api.v1.ParameterServer/Status")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await status(b"", timeout=5)
        assert TLS_MISMATCH_HINT not in from_rpc_error(raised.value).message


# ---------------------------------------------------------------- metrics: reduce mode, refusals
async def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


async def _code(address: str, method: str, token: str | None = None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await channel.unary_unary(method)(b"", metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _refusals(samples: dict[Any, float], method: str, code: str) -> float:
    return samples.get(
        ("paramserver_auth_refusals_total", (("code", code), ("method", method))), 0.0
    )


async def test_token_refusals_are_counted_by_every_server_with_metrics(tmp_path: Path) -> None:
    tokens = make_tokens(tmp_path / "tokens")
    ps = "/paramserver.api.v1.ParameterServer/"
    async with running_server(consistency="asp", auth_tokens=tokens.path, metrics_port=0) as srv:
        assert srv.metrics is not None
        for _ in range(2):
            assert await _code(srv.address, ps + "Status") == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(srv.address, ps + "Status", "x" * 20) == grpc.StatusCode.UNAUTHENTICATED
        denied = await _code(srv.address, ps + "Checkpoint", tokens.worker)
        assert denied == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(srv.address, ps + "Status", tokens.worker) == grpc.StatusCode.OK
        samples = await _scrape(srv.metrics.port)
        assert _refusals(samples, "Status", "UNAUTHENTICATED") == 3
        assert _refusals(samples, "Checkpoint", "PERMISSION_DENIED") == 1
        assert _refusals(samples, "Status", "PERMISSION_DENIED") == 0

    rs = "/paramserver.api.v1.ReductionService/"
    async with running_server(mode="reduce", auth_tokens=tokens.path, metrics_port=0) as red:
        assert red.metrics is not None
        assert await _code(red.address, rs + "Status") == grpc.StatusCode.UNAUTHENTICATED
        for _ in range(3):
            assert await _code(red.address, rs + "Status", tokens.worker) == grpc.StatusCode.OK
        samples = await _scrape(red.metrics.port)
        assert _refusals(samples, "Status", "UNAUTHENTICATED") == 1
        # --mode reduce serves the RPC series too (it used to ignore --metrics-port)
        ok = samples[("paramserver_rpcs_total", (("method", "Status"), ("outcome", "ok")))]
        assert ok == 3
        assert samples[("paramserver_rpc_duration_seconds_count", (("method", "Status"),))] == 3

    rank = await start_rank_server(
        RankServerConfig(
            instance_id="a",
            rank=0,
            object_dir=None,
            disk_dir=tmp_path / "rank",
            security=ServerSecurity(auth_tokens=tokens.path),
            metrics_port=0,
        )
    )
    try:
        assert rank.metrics is not None
        address = f"127.0.0.1:{rank.port}"
        method = "/paramserver.api.v1.RankServer/ImportMetadata"
        assert await _code(address, method, tokens.worker) == grpc.StatusCode.PERMISSION_DENIED
        samples = await _scrape(rank.metrics.port)
        assert _refusals(samples, "ImportMetadata", "PERMISSION_DENIED") == 1
    finally:
        await rank.stop(0.2)


async def test_metrics_endpoint_answers_431_to_an_overlong_request_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /" + b"a" * 70_000 + b" HTTP/1.0\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.0 431 "), answer[:100]
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")  # still serving
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.0 200")
        writer.close()
    finally:
        await server.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "answered 431" in caplog.text


# ---------------------------------------------------------------- TLS files and tokens at load
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.slow
def test_mismatched_pair_refused_by_every_server_command(pki: Pki) -> None:
    pair = ("--tls-cert", pki.server_cert, "--tls-key", pki.client_key)
    for cmd in (
        ("serve", "--mode", "reduce", "--port", "0"),
        ("rank-server", "--instance-id", "a", "--rank", "0"),
    ):
        proc = _paramserver(*cmd, *pair)
        line = _one_clean_line(proc)
        assert proc.returncode == 2, line
        assert f"--tls-key {pki.client_key!r} does not match --tls-cert" in line, line


def test_client_pair_and_ca_are_checked_when_loaded(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not match") as err:
        ClientSecurity(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.other_client_key)
    assert pki.client_cert in err.value.message and pki.other_client_key in err.value.message
    broken = tmp_path / "broken.key"
    broken.write_text("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InvalidArgument, match="cannot load the pair") as err:
        ServerSecurity(tls_cert=pki.server_cert, tls_key=str(broken))
    assert str(broken) in err.value.message and pki.server_cert in err.value.message
    bad_ca = tmp_path / "bad-ca.pem"
    bad_ca.write_text("-----BEGIN CERTIFICATE-----\nbm9wZQ==\n-----END CERTIFICATE-----\n")
    with pytest.raises(InvalidArgument, match=rf"--tls-ca {re.escape(repr(str(bad_ca)))}"):
        ClientSecurity(tls_ca=str(bad_ca))


def test_passphrase_protected_key_is_refused_without_a_prompt(pki: Pki, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(Path(pki.server_key).read_bytes(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(InvalidArgument, match="passphrase-protected") as err:
        ServerSecurity(tls_cert=pki.server_cert, tls_key=str(locked))
    assert str(locked) in err.value.message


def test_tls_server_name_needs_tls(pki: Pki) -> None:
    with pytest.raises(InvalidArgument, match=r"--tls-server-name needs TLS \(--tls-ca\)"):
        ClientSecurity.from_sources({"tls_server_name": "ps.example"}, {})
    with pytest.raises(InvalidArgument, match="--tls-server-name needs TLS"):
        peer_security(None, "t" * 20, "ps.example")
    assert ClientSecurity(tls_ca=pki.ca, tls_server_name="ps.example").tls


def test_tokens_must_be_printable_ascii_and_errors_name_the_source(tmp_path: Path) -> None:
    token = "tökenxxxxxxxxxxxxxx"
    with pytest.raises(InvalidArgument, match=r"PARAMSERVER_TOKEN.*printable ASCII") as err:
        ClientSecurity.from_sources(None, {"PARAMSERVER_TOKEN": token})
    assert token not in err.value.message
    token_file = tmp_path / "client.token"
    token_file.write_text(token + "\n", encoding="utf-8")
    with pytest.raises(InvalidArgument, match="printable ASCII") as err:
        ClientSecurity(token_file=str(token_file))
    assert str(token_file) in err.value.message and token not in err.value.message
    with pytest.raises(InvalidArgument, match="printable ASCII"):
        TokenTable.parse(f"worker {token}\n")
    tokens = make_tokens(tmp_path / "tokens")
    with pytest.raises(InvalidArgument) as err:  # the server's role file given to a client
        ClientSecurity(token_file=tokens.path)
    assert err.value.message == (
        f"--token-file {tokens.path!r}: a client token file holds one token on one line; "
        "this looks like a server --auth-tokens file"
    )
    assert tokens.worker not in err.value.message and tokens.admin not in err.value.message
    env = {"PARAMSERVER_TOKEN_FILE": tokens.worker_file}
    assert ClientSecurity.from_env(env).token == tokens.worker


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["serve", "--malloc-retain-bytes", "abc"],
            "paramserver serve: error: argument --malloc-retain-bytes: invalid int value: 'abc'",
        ),
        (["serve", "--lease-ms", "1.5"], "paramserver serve: error: argument --lease-ms"),
        (["bogus"], "paramserver: error: argument command: invalid choice: 'bogus'"),
        ([], "paramserver: error: the following arguments are required: command"),
    ],
)
def test_flag_syntax_errors_are_one_line_exit_2(argv: list[str], expected: str) -> None:
    proc = _paramserver(*argv)
    line = _one_clean_line(proc)
    assert proc.returncode == 2 and line.startswith(expected) and "--help" in line, line
    assert "usage:" not in proc.stderr


@pytest.mark.slow
def test_a_malloc_limit_below_glibc_threshold_is_refused_in_one_line() -> None:
    # 512 meant as MiB would lower glibc's own 128 KiB threshold and slow the server down.
    proc = _paramserver("serve", "--port", "0", "--malloc-retain-bytes", "512")
    line = _one_clean_line(proc)
    assert proc.returncode == 2 and "malloc_retain_bytes" in line and "got 512" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("source", ["flag", "env"])
def test_a_negative_object_limit_names_the_flag_and_its_variable(source: str) -> None:
    argv = ["rank-server", "--instance-id", "a", "--rank", "0", "--port", "0"]
    env: dict[str, str] = {}
    if source == "flag":
        argv += ["--max-object-bytes", "-1"]
    else:
        env["PARAMSERVER_SPMD_MAX_OBJECT_BYTES"] = "-1"
    proc = _paramserver(*argv, env=env)
    line = _one_clean_line(proc)
    assert proc.returncode == 2, line
    assert "--max-object-bytes (PARAMSERVER_SPMD_MAX_OBJECT_BYTES) must be >= 0, got -1" in line
