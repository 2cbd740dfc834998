"""Server configuration: a frozen dataclass, validated, with units in field names.

Precedence (highest first): command-line flag, ``PARAMSERVER_*`` environment variable, default.
Each field ``x`` reads ``PARAMSERVER_X`` (upper case), e.g. ``PARAMSERVER_LEASE_MS=2000``.
The environment mapping is passed in (:meth:`ServerConfig.from_sources`), so tests never touch
``os.environ``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from paramserver.errors import InvalidArgument
from paramserver.server.consistency import Consistency, DeathPolicy

ENV_PREFIX = "PARAMSERVER_"
AGGREGATIONS = ("mean", "sum", "weighted_mean")


@dataclass(frozen=True)
class ServerConfig:
    """Configuration of one server shard (``paramserver serve``).

    Attributes:
        host: Interface to bind (``127.0.0.1``; ``0.0.0.0`` inside containers).
        port: TCP port; 0 picks an ephemeral port.
        consistency: ``bsp``, ``ssp`` or ``asp``.
        staleness: SSP bound s in clocks (ignored by BSP, which is s = 0, and ASP).
        aggregation: ``mean``, ``sum`` or ``weighted_mean`` (by num_samples) for BSP steps.
        lease_ms: Worker lease in milliseconds; heartbeats renew it.
        death_policy: BSP/SSP worker-death policy: ``shrink`` (default), ``fail_fast``, ``wait``.
        wait_timeout_ms: Deadline of a consistency wait when the request gives none.
        allow_non_finite: Accept NaN/Inf gradients (refused by default).
        max_staleness: ASP only: drop gradients computed from parameters more than this many
            versions old (None: never drop).
        max_receive_message_bytes: gRPC receive limit per message (frames are ~1 MiB).
        max_tensor_bytes: Largest tensor accepted in one push/init (None: unlimited).
        checkpoint_dir: Directory of checkpoints; None disables them.
        checkpoint_every_steps: Periodic checkpoint every N closed steps / min clocks (0: off).
        keep_checkpoints: Committed checkpoints kept.
        grace_s: Graceful-shutdown grace period in seconds.
        use_uvloop: Run the daemon on uvloop when it is installed.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    consistency: str = "bsp"
    staleness: int = 0
    aggregation: str = "mean"
    lease_ms: int = 10_000
    death_policy: str = "shrink"
    wait_timeout_ms: int = 60_000
    allow_non_finite: bool = False
    max_staleness: int | None = None
    max_receive_message_bytes: int = 4 * 1024 * 1024
    max_tensor_bytes: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 3
    grace_s: float = 5.0
    use_uvloop: bool = True

    def __post_init__(self) -> None:
        try:
            Consistency(self.consistency)
        except ValueError:
            raise InvalidArgument(
                f"consistency must be one of bsp, ssp, asp; got {self.consistency!r}"
            ) from None
        try:
            DeathPolicy(self.death_policy)
        except ValueError:
            raise InvalidArgument(
                f"death_policy must be one of shrink, fail_fast, wait; got {self.death_policy!r}"
            ) from None
        if self.aggregation not in AGGREGATIONS:
            raise InvalidArgument(
                f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {self.aggregation!r}"
            )
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        for name in ("staleness", "checkpoint_every_steps"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "lease_ms",
            "wait_timeout_ms",
            "max_receive_message_bytes",
            "keep_checkpoints",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.grace_s < 0:
            raise InvalidArgument(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def consistency_model(self) -> Consistency:
        return Consistency(self.consistency)

    @property
    def policy(self) -> DeathPolicy:
        return DeathPolicy(self.death_policy)

    @classmethod
    def from_sources(
        cls, cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build a config: CLI values (None = not given) over ``PARAMSERVER_*`` env over defaults.

        Raises:
            InvalidArgument: a value that does not parse or validate (INVALID_ARGUMENT).
        """
        values: dict[str, Any] = {}
        cli = cli or {}
        env = env or {}
        for f in fields(cls):
            if cli.get(f.name) is not None:
                values[f.name] = cli[f.name]
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _parse(f, raw)
        return cls(**values)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = str(f.type)
    name = ENV_PREFIX + f.name.upper()
    raw = raw.strip()
    try:
        if "None" in kind and raw.lower() in ("", "none"):
            return None
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not a valid {kind}") from None
    return raw
