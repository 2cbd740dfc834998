"""The keyword arguments of the worker clients, typed once.

:class:`SessionOptions` are the keywords every worker session takes (the parameter-server
and the reduction clients); :class:`ClientOptions`, which extends it, is the keyword signature of
:class:`~paramserver.worker_client.client.WorkerClient` (documented there);
:func:`~paramserver.worker_client.connect`, ``connect_cluster``, ``connect_sync`` and the
cluster and blocking clients take the same keywords through ``**options:
Unpack[ClientOptions]``, so a type checker checks every caller's names and types (a test keeps
this dictionary and the constructor's signature equal). The per-call options of ``push``,
``pull`` and ``push_pull``, and of the several-table row pulls, are typed the same way for the
clients that forward them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Required, TypedDict

from paramserver.protocol.keepalive import ChannelOption
from paramserver.security.tls import ClientSecurity
from paramserver.worker_client.compression import Compression
from paramserver.worker_client.retry import RetryPolicy

__all__ = [
    "ClientOptions",
    "PullOptions",
    "PullRowsManyOptions",
    "PushOptions",
    "PushPullOptions",
    "SessionOptions",
    "ValidatedPullOptions",
]


class SessionOptions(TypedDict, total=False):
    """Keyword arguments every worker session takes, the parameter server's and the reduction
    service's (:class:`~paramserver.worker_client.lifecycle.ServiceSession`, documented there)."""

    replace: bool
    rpc_timeout_s: float
    retry: RetryPolicy | None
    heartbeat: bool
    channel_options: Sequence[ChannelOption]
    security: ClientSecurity | None


class ClientOptions(SessionOptions, total=False):
    """Keyword arguments of :class:`~paramserver.worker_client.client.WorkerClient`: those of
    every session, then its own."""

    wait_timeout_s: float | None
    resume: bool
    auto_reregister: bool
    close_timeout_s: float
    compression: Mapping[str, Compression] | None
    session: bool
    shared_memory: bool
    shared_memory_dir: str | Path | None
    local_link: bool
    recycle_pull_buffers: bool
    pull_buffer_max_bytes: int
    cast_gradients: bool
    register: bool


class PushOptions(TypedDict, total=False):
    """Keyword arguments of ``push`` (see :meth:`WorkerClient.push`)."""

    num_samples: int
    base_version: int | None
    timeout_s: float | None
    cast: bool | None


class PullOptions(TypedDict, total=False):
    """Keyword arguments of ``pull`` (see :meth:`WorkerClient.pull`)."""

    timeout_s: float | None
    observer: bool
    copy: bool


class PushPullOptions(TypedDict, total=False):
    """Keyword arguments of ``push_pull`` (see :meth:`WorkerClient.push_pull`)."""

    num_samples: int
    base_version: int | None
    timeout_s: float | None
    copy: bool
    cast: bool | None


class PullRowsManyOptions(TypedDict, total=False):
    """Keyword arguments of ``pull_rows_many`` (see :meth:`WorkerClient.pull_rows_many`)."""

    timeout_s: float | None
    observer: bool
    cache_counts: Mapping[str, tuple[int, int]] | None


class ValidatedPullOptions(TypedDict, total=False):
    """Keyword arguments of ``pull_rows_validated`` (see
    :meth:`WorkerClient.pull_rows_validated`)."""

    max_version_lag: Required[int]
    timeout_s: float | None
    cache_counts: Mapping[str, tuple[int, int]] | None
