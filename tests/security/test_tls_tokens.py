"""Unit tests of paramserver.security.tls: the RPC role table, token files, the token verdicts of
the server interceptor, and the precedence and validation of the security settings (no
sockets; the TLS handshakes are in tests/security/test_authentication.py)."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

import paramserver.api.v1 as api
from paramserver.errors import InvalidArgument, PermissionDenied, Unauthenticated, from_rpc_error
from paramserver.security.tls import (
    ClientSecurity,
    ServerSecurity,
    endpoint_security,
    token_from_sources,
)
from paramserver.security.tokens import (
    OPEN_SERVICES,
    RPC_ROLES,
    Role,
    TokenAuthInterceptor,
    TokenTable,
)
from paramserver.server.config import ServerConfig

pytestmark = pytest.mark.timeout(30)

WORKER = "worker-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


def all_rpcs() -> set[str]:
    """Every ``/package.Service/Method`` of every generated service module."""
    names: set[str] = set()
    for info in pkgutil.iter_modules(api.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{api.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            names.update(f"/{service.full_name}/{m.name}" for m in service.methods)
    return names


def test_every_rpc_of_every_service_is_classified() -> None:
    rpcs = all_rpcs()
    assert len(rpcs) >= 30  # ParameterServer, ReductionService, PushSumPeer, RankServer
    missing = sorted(rpcs - set(RPC_ROLES))
    assert not missing, f"classify these RPCs in paramserver.security.tokens.RPC_ROLES: {missing}"
    admin = {name for name, role in RPC_ROLES.items() if role is Role.ADMIN}
    assert admin == {
        "/paramserver.api.v1.ParameterServer/Checkpoint",
        "/paramserver.api.v1.Replication/Replicate",
        "/paramserver.api.v1.RankServer/ImportMetadata",
        "/paramserver.api.v1.RankServer/ForgetRemote",
    }
    assert RPC_ROLES["/paramserver.api.v1.ParameterServer/Session"] is Role.WORKER
    assert not any(name.split("/")[1] in OPEN_SERVICES for name in rpcs)


# --------------------------------------------------------------------------- token files
def test_token_file_roles_comments_and_rotation() -> None:
    table = TokenTable.parse(
        f"# role token\n\nworker {WORKER}\nWORKER {WORKER}-next  # rotation\nadmin\t{ADMIN}\n"
    )
    assert table.role_of(WORKER) is Role.WORKER
    assert table.role_of(WORKER + "-next") is Role.WORKER
    assert table.role_of(ADMIN) is Role.ADMIN
    assert table.role_of(WORKER[:-1]) is None
    assert table.role_of("") is None
    assert Role.ADMIN > Role.WORKER  # admin implies worker
    assert WORKER not in repr(table) and ADMIN not in repr(table)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no 'ROLE TOKEN' line"),
        ("# only a comment\n", "no 'ROLE TOKEN' line"),
        (f"worker {WORKER} extra more\n", "line 1: expected 'ROLE TOKEN'"),
        (f"admin {WORKER} alice\n", "line 1: only worker tokens take a worker name"),
        (f"worker\nadmin {ADMIN}\n", "line 1: expected 'ROLE TOKEN'"),
        (f"root {ADMIN}\n", "line 1: unknown role 'root'"),
        ("worker short\n", "at least|>= 16"),
        (f"worker {WORKER}\nadmin {WORKER}\n", "listed twice"),
    ],
)
def test_bad_token_files_are_refused_without_echoing_tokens(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as err:
        TokenTable.parse(text, "tokens.txt")
    assert "tokens.txt" in err.value.message
    assert WORKER not in err.value.message and ADMIN not in err.value.message
    assert "short" not in err.value.message.replace("shortest", "")


def test_token_file_missing_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"nope\.txt"):
        TokenTable.from_file(str(tmp_path / "nope.txt"))


# --------------------------------------------------------------------------- interceptor
def metadata(token: str | None, scheme: str = "Bearer") -> tuple[tuple[str, str], ...]:
    base = (("user-agent", "test"),)
    return base if token is None else (*base, ("authorization", f"{scheme} {token}"))


@pytest.mark.parametrize(
    ("method", "token", "expected"),
    [
        ("/paramserver.api.v1.ParameterServer/Push", WORKER, None),
        ("/paramserver.api.v1.ParameterServer/Push", ADMIN, None),
        ("/paramserver.api.v1.ParameterServer/Checkpoint", ADMIN, None),
        ("/paramserver.api.v1.ParameterServer/Checkpoint", WORKER, "PERMISSION_DENIED"),
        ("/paramserver.api.v1.RankServer/ImportMetadata", WORKER, "PERMISSION_DENIED"),
        ("/paramserver.api.v1.ParameterServer/Push", None, "UNAUTHENTICATED"),
        ("/paramserver.api.v1.ParameterServer/Push", WORKER + "x", "UNAUTHENTICATED"),
        ("/paramserver.api.v1.ParameterServer/Push", WORKER.upper(), "UNAUTHENTICATED"),
        ("/paramserver.api.v1.ParameterServer/Unclassified", ADMIN, "PERMISSION_DENIED"),
        ("/other.Service/Method", ADMIN, "PERMISSION_DENIED"),
    ],
)
def test_verdicts(method: str, token: str | None, expected: str | None) -> None:
    auth = TokenAuthInterceptor(TokenTable(((WORKER, Role.WORKER), (ADMIN, Role.ADMIN))))
    verdict = auth._verdict(method, metadata(token))
    assert (verdict[0].name if verdict else None) == expected
    if verdict is not None:
        assert WORKER not in verdict[1] and ADMIN not in verdict[1]


def test_bearer_scheme_is_case_insensitive_and_other_schemes_are_unauthenticated() -> None:
    auth = TokenAuthInterceptor(TokenTable(((WORKER, Role.WORKER),)))
    push = "/paramserver.api.v1.ParameterServer/Push"
    assert auth._verdict(push, metadata(WORKER, "bearer")) is None
    verdict = auth._verdict(push, metadata(WORKER, "Basic"))
    assert verdict is not None and verdict[0] == grpc.StatusCode.UNAUTHENTICATED


async def test_open_services_pass_and_refusals_keep_the_streaming_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    auth = TokenAuthInterceptor(TokenTable(((WORKER, Role.WORKER),)))

    async def stream_handler(requests: Any, context: Any) -> None:
        raise AssertionError("a refused call must not reach its handler")

    real = grpc.stream_stream_rpc_method_handler(stream_handler)

    async def continuation(details: Any) -> Any:
        return real

    health = SimpleNamespace(method="/grpc.health.v1.Health/Watch", invocation_metadata=())
    assert await auth.intercept_service(continuation, health) is real
    push = SimpleNamespace(
        method="/paramserver.api.v1.ParameterServer/Session", invocation_metadata=()
    )
    refused = await auth.intercept_service(continuation, push)
    assert refused is not real
    assert refused.request_streaming and refused.response_streaming

    class Context:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:5555"

        async def abort(self, code: grpc.StatusCode, detail: str) -> None:
            raise RuntimeError(f"{code.name}: {detail}")

    with (
        caplog.at_level(logging.WARNING, logger="paramserver.security.tokens"),
        pytest.raises(RuntimeError, match="UNAUTHENTICATED"),
    ):
        await refused.stream_stream(iter(()), Context())
    assert "ipv4:127.0.0.1:5555" in caplog.text and "Session" in caplog.text
    assert auth.refused == {"UNAUTHENTICATED": 1}


def test_client_funnel_maps_the_auth_codes() -> None:
    class Err(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return "refused"

        def trailing_metadata(self) -> tuple[()]:
            return ()

    assert isinstance(from_rpc_error(Err(grpc.StatusCode.UNAUTHENTICATED)), Unauthenticated)
    assert isinstance(from_rpc_error(Err(grpc.StatusCode.PERMISSION_DENIED)), PermissionDenied)


# --------------------------------------------------------------------------- settings
def _self_signed() -> tuple[bytes, bytes]:
    """A real self-signed certificate (also usable as its own CA) and its key, PEM: the
    settings load certificate and key as TLS would, so fakes no longer pass."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "unit")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    cert, key = _self_signed()
    files = {"cert": cert, "key": key, "ca": cert}
    out = {}
    for name, data in files.items():
        path = tmp_path / f"{name}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        out[name] = str(path)
    token = tmp_path / "token"
    token.write_text(f"\n{WORKER}\n")
    token.chmod(0o600)
    out["token"] = str(token)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"worker {WORKER}\nadmin {ADMIN}\n")
    tokens.chmod(0o600)
    out["tokens"] = str(tokens)
    return out


def test_client_precedence_flag_then_env_then_default(pem: dict[str, str], tmp_path: Path) -> None:
    assert not ClientSecurity.from_sources({}, {}).enabled
    env = {"PARAMSERVER_TLS_CA": pem["ca"], "PARAMSERVER_TOKEN": ADMIN}
    from_env = ClientSecurity.from_sources({}, env)
    assert from_env.tls and from_env.tls_ca == pem["ca"] and from_env.token == ADMIN
    other = tmp_path / "other-ca.pem"
    other.write_bytes(Path(pem["ca"]).read_bytes())
    flagged = ClientSecurity.from_sources({"tls_ca": str(other), "token_file": pem["token"]}, env)
    assert flagged.tls_ca == str(other) and flagged.token == WORKER  # flags win
    env_file = ClientSecurity.from_sources({}, env | {"PARAMSERVER_TOKEN_FILE": pem["token"]})
    assert env_file.token == WORKER  # a token file wins over the token variable
    assert token_from_sources(None, {"PARAMSERVER_TOKEN": f" {ADMIN} "}) == ADMIN
    assert token_from_sources(None, {}) is None
    assert WORKER not in repr(flagged) and ADMIN not in repr(from_env)
    assert ClientSecurity(token=WORKER).describe() == "plain text, bearer token"


def test_server_config_reads_security_from_the_environment(pem: dict[str, str]) -> None:
    env = {
        "PARAMSERVER_TLS_CERT": pem["cert"],
        "PARAMSERVER_TLS_KEY": pem["key"],
        "PARAMSERVER_TLS_CA": pem["ca"],
        "PARAMSERVER_AUTH_TOKENS": pem["tokens"],
    }
    config = ServerConfig.from_sources({"tls_ca": None}, env)
    security = ServerSecurity.of_config(config)
    assert security is not None and security.tls and security.mutual_tls
    assert security.tokens is not None and security.tokens.role_of(ADMIN) is Role.ADMIN
    assert security.describe() == "mutual TLS, 2 bearer tokens"
    assert ServerSecurity.of_config(ServerConfig()) is None


def test_invalid_settings_name_what_is_wrong(pem: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="--tls-cert and --tls-key go together"):
        ServerSecurity(tls_cert=pem["cert"])
    with pytest.raises(InvalidArgument, match="--tls-cert and --tls-key go together"):
        ClientSecurity(tls_key=pem["key"])
    with pytest.raises(InvalidArgument, match="mutual TLS"):
        ServerSecurity(tls_ca=pem["ca"])
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(InvalidArgument, match=r"--tls-cert: cannot read .*missing\.pem"):
        ServerSecurity(tls_cert=missing, tls_key=pem["key"])
    with pytest.raises(InvalidArgument, match=r"--tls-ca: .*key\.pem.* no PEM CERTIFICATE"):
        ClientSecurity(tls_ca=pem["key"])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(InvalidArgument, match=r"--token-file: .*empty.* is empty"):
        ClientSecurity(token_file=str(empty))
    with pytest.raises(InvalidArgument, match="whitespace"):
        ClientSecurity(token="two words")


def test_endpoint_security_of_a_gossip_worker(pem: dict[str, str]) -> None:
    assert endpoint_security(None) is None
    plain = endpoint_security(ClientSecurity(token=WORKER))
    assert plain is not None and not plain.tls and plain.tokens is not None
    assert plain.tokens.role_of(WORKER) is Role.WORKER
    full = endpoint_security(
        ClientSecurity(tls_ca=pem["ca"], tls_cert=pem["cert"], tls_key=pem["key"], token=WORKER)
    )
    assert full is not None and full.mutual_tls
    with pytest.raises(InvalidArgument, match="certificate and key of its own"):
        endpoint_security(ClientSecurity(tls_ca=pem["ca"]))


def test_command_line_flags_of_servers_and_clients(pem: dict[str, str], tmp_path: Path) -> None:
    from paramserver.cli.main import build_parser
    from paramserver.cli.rank import config_from_args
    from paramserver.security.tls import client_security_from_args

    parser = build_parser()
    tls = ["--tls-cert", pem["cert"], "--tls-key", pem["key"], "--tls-ca", pem["ca"]]
    rank = ["rank-server", "--instance-id", "A", "--rank", "0", "--disk-dir", str(tmp_path)]
    args = parser.parse_args(
        [*rank, *tls, "--auth-tokens", pem["tokens"], "--token-file", pem["token"]]
    )
    config = config_from_args(args, {})
    assert config.security is not None and config.security.mutual_tls
    assert config.security.tokens is not None
    peer = config.peer_security
    assert peer is not None and peer.tls and peer.token == WORKER  # presented to its peers
    assert peer.tls_cert == pem["cert"] and peer.tls_ca == pem["ca"]
    plain = config_from_args(
        parser.parse_args(["rank-server", "--instance-id", "A", "--rank", "0"]), {}
    )
    assert plain.security is None and plain.peer_security is None
    for command in (
        ["worker", "--server", "h:1", "--worker-index", "0", "--num-workers", "1"],
        ["status", "--server", "h:1"],
        ["checkpoint", "--server", "h:1"],
        ["health", "--server", "h:1"],
        ["cluster-check", "--server", "h:1", "--results-dir", "r", "--expect", "w"],
        ["spmd-demo", "--instance-a", "h:1", "--instance-b", "h:2"],
    ):
        parsed = parser.parse_args([*command, "--tls-ca", pem["ca"], "--token-file", pem["token"]])
        security = client_security_from_args(parsed, {"PARAMSERVER_TOKEN": ADMIN})
        assert security is not None and security.tls and security.token == WORKER, command
    serve = parser.parse_args(["serve", *tls, "--auth-tokens", pem["tokens"]])
    assert (serve.tls_cert, serve.tls_ca, serve.auth_tokens) == (
        pem["cert"],
        pem["ca"],
        pem["tokens"],
    )
