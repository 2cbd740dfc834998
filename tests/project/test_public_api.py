"""The public API of ``import paramserver``: the exported names are locked, each resolves to the
object its home module defines, and importing the package loads none of them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import paramserver

pytestmark = pytest.mark.timeout(60)

#: Changing this list is an API change: add to it deliberately, remove only with a deprecation.
EXPORTED = [
    "Aborted",
    "AlreadyExists",
    "Cast",
    "ClientSecurity",
    "ClusterWorkerClient",
    "DimensionMismatch",
    "FailedPrecondition",
    "GossipWorker",
    "Initializer",
    "InvalidArgument",
    "KeyNotFound",
    "Layout",
    "LocalCluster",
    "ParamServerError",
    "PermissionDenied",
    "PushAck",
    "ReductionClient",
    "ResourceExhausted",
    "RetryPolicy",
    "RowPushAck",
    "SpmdParallelWorkers",
    "SyncWorkerClient",
    "TableRule",
    "TableSpec",
    "Tier",
    "TopK",
    "Unauthenticated",
    "Unavailable",
    "UpdateRule",
    "WaitTimeout",
    "WorkerClient",
    "__version__",
    "connect",
    "connect_from_env",
    "connect_reduction",
    "connect_sync",
    "connect_sync_from_env",
    "local_cluster",
]


def test_exported_names_are_locked() -> None:
    assert sorted(paramserver.__all__) == EXPORTED


@pytest.mark.parametrize("name", [n for n in EXPORTED if n != "__version__"])
def test_each_name_is_its_home_modules_object(name: str) -> None:
    import importlib

    value = getattr(paramserver, name)
    home = importlib.import_module(value.__module__)
    assert getattr(home, name) is value
    assert name in dir(paramserver)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'connect_everything'"):
        paramserver.connect_everything  # noqa: B018


def test_import_loads_no_submodule_and_star_import_works() -> None:
    code = (
        "import sys, paramserver\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('paramserver.'))\n"
        "assert loaded == [], loaded\n"
        "ns = {}\n"
        "exec('from paramserver import *', ns)\n"
        "assert 'connect' in ns and 'SpmdParallelWorkers' in ns\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


def test_worker_client_imports_nothing_from_the_server() -> None:
    """The client package stands on protocol/ and core/ alone: a worker host needs no server."""
    code = (
        "import sys, paramserver.worker_client, paramserver.worker_client.sync\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('paramserver.server',"
        " 'paramserver.cli', 'paramserver.spmd')))\n"
        "assert bad == [], bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
