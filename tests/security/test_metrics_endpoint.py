"""The metrics endpoint binds to loopback by default and offers a bearer token and TLS
(issue 19, item 7; docs/security.md)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from paramserver.server.config import ServerConfig
from tests.harness import running_server
from tests.harness.pki import make_pki

pytestmark = pytest.mark.timeout(60)

TOKEN = "metrics-token-0123456789abcdef"


def _get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> int:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            assert b"paramserver_" in resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_metrics_endpoint_defaults_to_loopback() -> None:
    assert ServerConfig().metrics_host == "127.0.0.1"
    assert ServerConfig.from_sources({}, {"PARAMSERVER_METRICS_HOST": "0.0.0.0"}).metrics_host == (
        "0.0.0.0"
    )


async def test_a_server_on_all_interfaces_keeps_its_metrics_on_loopback() -> None:
    async with running_server(consistency="asp", host="0.0.0.0", metrics_port=0) as srv:
        assert srv.metrics is not None and srv.metrics._server is not None
        bound = {sock.getsockname()[0] for sock in srv.metrics._server.sockets}
        assert bound == {"127.0.0.1"}


async def test_a_metrics_token_is_required_on_every_path(tmp_path: Path) -> None:
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    async with running_server(
        consistency="asp", metrics_port=0, metrics_token_file=str(token_file)
    ) as srv:
        assert srv.metrics is not None
        base = f"http://127.0.0.1:{srv.metrics.port}"
        loop = asyncio.get_running_loop()
        for path in ("/metrics", "/", "/anything"):
            code = await loop.run_in_executor(None, _get, base + path)
            assert code == 401, path
        wrong = await loop.run_in_executor(None, _get, base + "/metrics", "x" * 30)
        assert wrong == 401
        assert await loop.run_in_executor(None, _get, base + "/metrics", TOKEN) == 200


async def test_metrics_over_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_server(
        consistency="asp",
        metrics_port=0,
        metrics_tls_cert=pki.server_cert,
        metrics_tls_key=pki.server_key,
    ) as srv:
        assert srv.metrics is not None
        ctx = ssl.create_default_context(cafile=pki.ca)
        loop = asyncio.get_running_loop()
        url = f"https://127.0.0.1:{srv.metrics.port}/metrics"
        assert await loop.run_in_executor(None, _get, url, None, ctx) == 200


async def test_a_rank_servers_metrics_default_to_loopback_and_take_a_token(tmp_path: Path) -> None:
    """The rank server's endpoint follows the same rules: loopback unless ``--metrics-host``
    says otherwise (also with ``--host 0.0.0.0``), and a bearer token on every path."""
    from paramserver.spmd.layout import Layout
    from paramserver.spmd.rank_server import RankServerConfig, start_rank_server

    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    config = RankServerConfig(
        instance_id="m",
        rank=0,
        host="0.0.0.0",
        port=0,
        layout=Layout(num_blocks=0, num_layers=1, outer_dim=1, page_size=4, inner_dim=8),
        host_blocks=2,
        disk_blocks=2,
        disk_dir=tmp_path / "disk",
        object_dir=None,
        metrics_port=0,
        metrics_token_file=str(token_file),
    )
    assert RankServerConfig(instance_id="d", rank=0).metrics_host == "127.0.0.1"
    handle = await start_rank_server(config)
    try:
        assert handle.metrics is not None and handle.metrics._server is not None
        bound = {sock.getsockname()[0] for sock in handle.metrics._server.sockets}
        assert bound == {"127.0.0.1"}
        base = f"http://127.0.0.1:{handle.metrics.port}"
        loop = asyncio.get_running_loop()
        for path in ("/metrics", "/"):
            assert await loop.run_in_executor(None, _get, base + path) == 401
        assert await loop.run_in_executor(None, _get, base + "/metrics", TOKEN) == 200
    finally:
        await handle.stop(0)
