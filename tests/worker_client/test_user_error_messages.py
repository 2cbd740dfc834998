"""Clear refusals for a new user's mistakes, on the pure pieces: address checks, the one-line
error form of the entry points, the status view per consistency model, aggregation log lines."""

from __future__ import annotations

import argparse
import logging

import grpc
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.cli.main import error_line, run_command
from paramserver.core.aggregation import DistributedOptimizer, Synchronous
from paramserver.errors import (
    InvalidArgument,
    KeyNotFound,
    ParamServerError,
    PermissionDenied,
    Unavailable,
)
from paramserver.protocol.addresses import parse_address
from paramserver.server.observability.status_table import render_status

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1:1", "localhost:65535", " ps-0.example_net:50051 ", "[::1]:8080", "[fe80::1%lo]:9"],
)
def test_parse_address_accepts_host_port(text: str) -> None:
    assert parse_address(text) == text.strip()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("127.0.0.1:99999", r"PORT in \[1, 65535\]"),
        ("127.0.0.1:0", r"PORT in \[1, 65535\]"),
        ("127.0.0.1:-1", "HOST:PORT expected"),
        ("127.0.0.1", "HOST:PORT expected"),
        (":50051", "HOST:PORT expected"),
        ("h:5x", "HOST:PORT expected"),
        ("::1:50051", r"IPv6 host goes in brackets: \[::1\]:50051"),
        ("[::1:50051", "brackets"),
        ("bad host:1", "bad host"),
        ("-h:1", "bad host"),
    ],
)
def test_parse_address_refuses_naming_the_flag(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"^--server: .* is not HOST:PORT .*{why}"):
        parse_address(text, "--server")


def test_port_zero_only_where_allowed() -> None:
    assert parse_address("h:0", allow_port_zero=True) == "h:0"
    with pytest.raises(InvalidArgument, match=r"PORT in \[0, 65535\]"):
        parse_address("h:65536", allow_port_zero=True)


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (InvalidArgument("bad"), "InvalidArgument (INVALID_ARGUMENT): bad"),
        (KeyNotFound("k"), "KeyNotFound (NOT_FOUND): k"),
        (ParamServerError("INTERNAL: boom"), "ParamServerError (INTERNAL): boom"),
    ],
)
def test_error_line_names_class_and_status(exc: ParamServerError, line: str) -> None:
    assert error_line(exc) == line


class _FailedRpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


@pytest.mark.parametrize(
    ("raised", "rc", "line"),
    [
        (InvalidArgument("--x must be >= 1"), 2, "InvalidArgument (INVALID_ARGUMENT): --x must"),
        (Unavailable("could not bind h:1: address in use"), 1, "Unavailable (UNAVAILABLE): could"),
        (
            _FailedRpc(grpc.StatusCode.PERMISSION_DENIED, "needs the admin role"),
            1,
            "PermissionDenied (PERMISSION_DENIED): needs the admin role",
        ),
    ],
)
def test_run_command_prints_one_line_with_the_exit_status(
    raised: BaseException, rc: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(_: argparse.Namespace) -> int:
        raise raised

    assert run_command("paramserver x", argparse.Namespace(func=fail), "text") == rc
    err = capsys.readouterr().err
    assert err == f"paramserver x: {line}" + err.split(line, 1)[1]
    assert err.count("\n") == 1


def test_run_command_logs_the_error_as_a_record_under_json(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(_: argparse.Namespace) -> int:
        raise PermissionDenied("no")

    with caplog.at_level(logging.ERROR, logger="paramserver.cli.main"):
        assert run_command("paramserver x", argparse.Namespace(func=fail), "json") == 1
    assert capsys.readouterr().err == ""  # the record goes through logging only
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "paramserver x: PermissionDenied (PERMISSION_DENIED): no"
    assert (record.__dict__["error"], record.__dict__["code"]) == (
        "PermissionDenied",
        "PERMISSION_DENIED",
    )


@pytest.mark.parametrize(
    ("consistency", "shows_bsp"),
    [(pb.CONSISTENCY_BSP, True), (pb.CONSISTENCY_SSP, False), (pb.CONSISTENCY_ASP, False)],
)
def test_status_shows_the_bsp_policy_and_step_only_under_bsp(
    consistency: int, shows_bsp: bool
) -> None:
    status = pb.StatusResponse(
        view=pb.ClusterView(consistency=consistency, live_workers=2), bsp_policy="shrink"
    )
    head = "\n".join(render_status(status, "h:1").splitlines()[:2])
    assert ("BSP policy shrink" in head) is shows_bsp
    assert ("BSP step" in head) is shows_bsp
    assert "membership epoch 0" in head


def test_aggregation_log_says_how_a_worker_went(caplog: pytest.LogCaptureFixture) -> None:
    opt = DistributedOptimizer(Synchronous())
    opt.register_worker("w-0")
    opt.register_worker("w-1")
    with caplog.at_level(logging.INFO, logger="paramserver.core.aggregation"):
        assert opt.evict_worker("w-0", "left")
        assert opt.evict_worker("w-1")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "worker 'w-0' left at step 0 (0 pending updates dropped)",
        "worker 'w-1' removed at step 0 (0 pending updates dropped)",
    ]
