"""Rendezvous from the environment: what a launcher tells each worker process it starts.

``paramserver run``, ``paramserver ray-launch --script`` and the Helm chart's worker Job start
a user's training script with these variables set, so one script runs unchanged under each
(as ``torch.distributed.init_process_group("env://")`` reads ``MASTER_ADDR`` and ``RANK``):

===============================  ==========================================================
variable                         meaning
===============================  ==========================================================
``PARAMSERVER_ADDRESS``          ``host:port`` of a server of the cluster (any shard; the
                                 client asks it for the shard map)
``PARAMSERVER_SHARD_ADDRESSES``  every shard's ``host:port``, comma-separated, in shard
                                 order (used when ``PARAMSERVER_ADDRESS`` is not set: its
                                 first entry)
``WORKER_INDEX``                 this worker's index, 0 .. ``NUM_WORKERS`` - 1
``NUM_WORKERS``                  how many workers the job has
``WORKER_NAME``                  the name it registers under (default ``worker-<index>``);
                                 a restarted worker keeps its name and resumes its progress
``PARAMSERVER_REPLACE``          ``1``: fence a live registration of the same name (a
                                 restarted worker whose predecessor's lease has not lapsed)
``PARAMSERVER_TOKEN_FILE``,      the client's bearer token and TLS files
``PARAMSERVER_TLS_*``            (:meth:`~paramserver.security.tls.ClientSecurity.from_env`)
===============================  ==========================================================

:func:`connect_from_env` and :func:`connect_sync_from_env` open the worker's session from
them; :class:`WorkerEnv` is what they read. The mapping is passed in (default ``os.environ``),
so tests never touch the process environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Unpack

from paramserver.errors import InvalidArgument
from paramserver.protocol.addresses import parse_server
from paramserver.worker_client.options import ClientOptions

if TYPE_CHECKING:
    from paramserver.worker_client.cluster import ClusterWorkerClient
    from paramserver.worker_client.sync import SyncWorkerClient

__all__ = [
    "ADDRESS_ENV",
    "NUM_WORKERS_ENV",
    "REPLACE_ENV",
    "SHARD_ADDRESSES_ENV",
    "WORKER_INDEX_ENV",
    "WORKER_NAME_ENV",
    "WorkerEnv",
    "connect_from_env",
    "connect_sync_from_env",
]

ADDRESS_ENV = "PARAMSERVER_ADDRESS"
SHARD_ADDRESSES_ENV = "PARAMSERVER_SHARD_ADDRESSES"
WORKER_INDEX_ENV = "WORKER_INDEX"
NUM_WORKERS_ENV = "NUM_WORKERS"
WORKER_NAME_ENV = "WORKER_NAME"
REPLACE_ENV = "PARAMSERVER_REPLACE"


def _int_var(env: Mapping[str, str], name: str, default: int, least: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise InvalidArgument(f"{name}={raw!r}: give an integer >= {least}")
    return value


@dataclass(frozen=True)
class WorkerEnv:
    """A worker's place in its job, as the launcher's environment states it.

    Attributes:
        address: ``host:port`` of a server of the cluster.
        shard_addresses: Every shard's address when the launcher gave them (else empty).
        worker_index: This worker's index (0 when not set: a single worker).
        num_workers: Workers in the job (1 when not set).
        worker_name: The name to register under (``worker-<index>`` when not set).
        replace: Fence a live registration of the same name.
    """

    address: str
    shard_addresses: tuple[str, ...]
    worker_index: int
    num_workers: int
    worker_name: str
    replace: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the variables of the module docstring from ``env`` (default ``os.environ``).

        Raises:
            InvalidArgument: no server address (neither ``PARAMSERVER_ADDRESS`` nor
                ``PARAMSERVER_SHARD_ADDRESSES``: start the script with ``paramserver run``),
                an address that is not ``HOST:PORT``, or an index or count that is not a
                number in range (INVALID_ARGUMENT, naming the variable).
        """
        env = os.environ if env is None else env
        shards = tuple(
            parse_server(a.strip(), SHARD_ADDRESSES_ENV)
            for a in env.get(SHARD_ADDRESSES_ENV, "").split(",")
            if a.strip()
        )
        raw = env.get(ADDRESS_ENV, "").strip()
        if raw:
            address = parse_server(raw, ADDRESS_ENV)
        elif shards:
            address = shards[0]
        else:
            raise InvalidArgument(
                f"no parameter server given: {ADDRESS_ENV} (or {SHARD_ADDRESSES_ENV}) is not "
                "set; start the script with `paramserver run SCRIPT` (or `paramserver "
                f"ray-launch --script SCRIPT`), or set {ADDRESS_ENV}=HOST:PORT"
            )
        num_workers = _int_var(env, NUM_WORKERS_ENV, 1, 1)
        index = _int_var(env, WORKER_INDEX_ENV, 0, 0)
        if index >= num_workers:
            raise InvalidArgument(
                f"{WORKER_INDEX_ENV}={index} is not below {NUM_WORKERS_ENV}={num_workers}"
            )
        name = env.get(WORKER_NAME_ENV, "").strip() or f"worker-{index}"
        replace = env.get(REPLACE_ENV, "").strip().lower() in ("1", "true", "yes")
        return cls(address, shards, index, num_workers, name, replace)


def _options(
    worker: WorkerEnv, env: Mapping[str, str] | None, options: ClientOptions
) -> ClientOptions:
    if "security" not in options:
        from paramserver.security.tls import ClientSecurity

        options["security"] = ClientSecurity.from_env(env)
    options.setdefault("replace", worker.replace)
    return options


def connect_from_env(
    env: Mapping[str, str] | None = None, **options: Unpack[ClientOptions]
) -> ClusterWorkerClient:
    """The async worker session a launcher's environment describes:
    ``async with ps.connect_from_env() as worker: ...``.

    The server, worker name and ``replace`` come from :class:`WorkerEnv`; the bearer token
    and TLS from ``PARAMSERVER_TOKEN_FILE`` / ``PARAMSERVER_TLS_*``. Keyword arguments are
    those of :func:`~paramserver.worker_client.connect` and win over the environment.

    Raises:
        InvalidArgument: see :meth:`WorkerEnv.from_env` (INVALID_ARGUMENT).
    """
    from paramserver.worker_client.cluster import connect

    worker = WorkerEnv.from_env(env)
    opts = _options(worker, env, options.copy())
    return connect(worker.address, worker.worker_name, **opts)


def connect_sync_from_env(
    env: Mapping[str, str] | None = None,
    *,
    call_timeout_s: float = 600.0,
    **options: Unpack[ClientOptions],
) -> SyncWorkerClient:
    """The blocking twin of :func:`connect_from_env`: ``with ps.connect_sync_from_env() as
    worker: ...`` (or ``.open()`` it, as the torch optimizer does).

    Raises:
        InvalidArgument: see :meth:`WorkerEnv.from_env` (INVALID_ARGUMENT).
    """
    from paramserver.worker_client.sync import connect_sync

    worker = WorkerEnv.from_env(env)
    opts = _options(worker, env, options.copy())
    return connect_sync(worker.address, worker.worker_name, call_timeout_s=call_timeout_s, **opts)
