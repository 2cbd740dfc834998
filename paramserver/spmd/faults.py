"""TEST-ONLY fault injection for rank servers.

A rank server reads ``PARAMSERVER_SPMD_FAULTS`` (a comma-separated list) once at start-up. It
exists only so that the integration tests can reproduce a failed or idle rank with real
processes (tests/spmd/test_cases.py); never set it in production.

Items:

``disk_write_error``
    every write into the G3 pool file fails with ``OSError(EIO)``.
``hang_commands``
    every block-moving command (local transfer, onboard, offload, put/get blocks) waits forever
    before doing any work; only its deadline (cancellation) ends it.
``io_delay_ms=N``
    sleep N milliseconds before each copied chunk (makes a transfer slow enough to be killed
    mid-way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from paramserver.errors import InvalidArgument

__all__ = ["FAULTS_ENV", "Faults"]

FAULTS_ENV = "PARAMSERVER_SPMD_FAULTS"
"""Environment variable holding the test-only fault list."""


@dataclasses.dataclass(frozen=True)
class Faults:
    """Injected faults of one rank server (TEST ONLY; all off by default).

    Attributes:
        disk_write_error: G3 writes raise ``OSError(EIO)``.
        hang_commands: block-moving commands hang until their deadline cancels them.
        io_delay_s: sleep before each copied chunk, seconds.
    """

    disk_write_error: bool = False
    hang_commands: bool = False
    io_delay_s: float = 0.0

    @property
    def any(self) -> bool:
        """True when at least one fault is on."""
        return self.disk_write_error or self.hang_commands or self.io_delay_s > 0

    @classmethod
    def parse(cls, text: str) -> Faults:
        """Parse the ``PARAMSERVER_SPMD_FAULTS`` syntax.

        Raises:
            InvalidArgument: unknown item (INVALID_ARGUMENT).
        """
        disk = hang = False
        delay = 0.0
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            if item == "disk_write_error":
                disk = True
            elif item == "hang_commands":
                hang = True
            elif item.startswith("io_delay_ms="):
                try:
                    delay = float(item.partition("=")[2]) / 1000.0
                except ValueError:
                    raise InvalidArgument(f"bad fault item {item!r}") from None
            else:
                raise InvalidArgument(f"unknown fault item {item!r} in {FAULTS_ENV}")
        return cls(disk, hang, delay)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Faults:
        """Read :data:`FAULTS_ENV` from ``env`` (injectable; tests never touch ``os.environ``)."""
        return cls.parse(env.get(FAULTS_ENV, ""))
