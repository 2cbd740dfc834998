"""Errors of the SPMD block-transfer layer, subclasses of :mod:`paramserver.errors`.

::

    ParamServerError                         (INTERNAL)
    ├── FailedPrecondition                   (FAILED_PRECONDITION)
    │   ├── TierNotRegistered                tier absent on this rank (G1 without a GPU, ...)
    │   ├── BlockNotValid                    block never written, or its last write failed
    │   ├── BlocksBusy                       another in-flight command writes these blocks
    │   └── StaleIncarnation                 the rank server restarted since its metadata
    ├── KeyNotFound                          (NOT_FOUND)
    │   ├── ObjectNotFound                   no object "{rank}/{sequence_hash}"
    │   └── RemoteNotConnected               no imported metadata for that instance
    ├── WaitTimeout                          (DEADLINE_EXCEEDED)
    │   └── CommandTimeout                   a command ran past its deadline and was cancelled
    └── RankFailures                         one group operation failed on >= 1 rank
        └── TransferFailed                   a transfer's merged completion failed

:class:`RankFailures` is raised on the client only; its ``code`` is the failing ranks' common
status code, or INTERNAL when they differ.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from paramserver.errors import (
    FailedPrecondition,
    KeyNotFound,
    ParamServerError,
    WaitTimeout,
)

__all__ = [
    "BlockNotValid",
    "BlocksBusy",
    "CommandTimeout",
    "ObjectNotFound",
    "RankFailures",
    "RemoteNotConnected",
    "StaleIncarnation",
    "TierNotRegistered",
    "TransferFailed",
]


class TierNotRegistered(FailedPrecondition):
    """The tier has no pool on this rank (e.g. G1 where no GPU is present). FAILED_PRECONDITION."""


class BlockNotValid(FailedPrecondition):
    """A source block holds no valid data (never written, or its last write failed)."""


class BlocksBusy(FailedPrecondition):
    """Another in-flight command is writing (or reading) blocks this command would write."""


class StaleIncarnation(FailedPrecondition):
    """The rank server restarted since the caller read its metadata. FAILED_PRECONDITION."""


class ObjectNotFound(KeyNotFound):
    """No committed object under ``"{rank}/{sequence_hash}"``. NOT_FOUND."""


class RemoteNotConnected(KeyNotFound):
    """No imported metadata for the named remote instance on this rank. NOT_FOUND."""


class CommandTimeout(WaitTimeout):
    """A command ran past its deadline; its work was cancelled. DEADLINE_EXCEEDED."""


class RankFailures(ParamServerError):
    """A group operation failed on one or more ranks; every failing rank is reported.

    Attributes:
        operation: name of the group method.
        failures: rank -> the error that rank reported (each message names its rank).
        results: rank -> the result of every rank that succeeded.
        worker_count: ranks in the group.
    """

    def __init__(
        self,
        operation: str,
        failures: Mapping[int, ParamServerError],
        results: Mapping[int, object],
        worker_count: int,
    ) -> None:
        self.operation = operation
        self.failures: dict[int, ParamServerError] = dict(sorted(failures.items()))
        self.results: dict[int, object] = dict(sorted(results.items()))
        self.worker_count = worker_count
        codes = {e.code for e in self.failures.values()}
        parts = "; ".join(f"rank {r}: {e.code.name}: {e.message}" for r, e in self.failures.items())
        ok = ", ".join(str(r) for r in self.results) or "none"
        super().__init__(
            f"{operation} failed on {len(self.failures)} of {worker_count} ranks "
            f"({parts}); ranks that succeeded: {ok}"
        )
        self.code = codes.pop() if len(codes) == 1 else grpc.StatusCode.INTERNAL

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that failed, ascending."""
        return list(self.failures)


class TransferFailed(RankFailures):
    """The merged completion of a transfer failed on one or more ranks."""
