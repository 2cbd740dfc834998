"""What a job on Ray returns: each worker's exit and the job's result."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from paramserver.integrations.ray.shard_actor import ShardInfo


@dataclass
class WorkerOutcome:
    """One worker task's exit.

    Attributes:
        index: Worker index.
        ok: It returned (no exception, not cancelled, within the deadline).
        result: Its return value (the digits job: its ``done`` summary).
        error: Why it failed (``None`` when ok).
        node_ip: IP of the node it last ran on (``None`` if unknown).
        starts: Times its task started (more than 1: Ray retried it, e.g. after its node
            was lost; a retried digits or MovieLens worker skips the batches already done).
    """

    index: int
    ok: bool
    result: object = None
    error: str | None = None
    node_ip: str | None = None
    starts: int = 1


@dataclass
class JobResult:
    """What a job on Ray returns to its driver.

    Attributes:
        workers: Every worker's exit, by index.
        shards: Every shard's state at the end (before teardown).
        metrics: Final metrics; the digits job: ``test_accuracy`` of the final parameters.
        elapsed_s: Seconds from the workers' submission to their last exit.
        state_dir: Where the shards kept their state, on each shard's node (what a later
            ``--restore-from`` reads).
        replicas: Replicas of each shard.
        failovers: Backups promoted to primary during the job (all shards).
        retried_workers: Indexes of the workers whose task Ray started more than once.
        error: Why the job failed as a whole (the shards did not start, the Ray head was
            lost...); None when it ran to its end.
    """

    workers: list[WorkerOutcome]
    shards: list[ShardInfo]
    metrics: dict[str, float | str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    state_dir: str = ""
    replicas: int = 1
    failovers: int = 0
    retried_workers: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The job ran to its end and every worker returned."""
        return self.error is None and all(w.ok for w in self.workers)

    @classmethod
    def failed(cls, error: str, state_dir: str = "") -> JobResult:
        """The result of a job that could not run to its end."""
        return cls(workers=[], shards=[], state_dir=state_dir, error=error)

    def to_json(self) -> str:
        """The result as one JSON object (worker results that JSON cannot hold as ``repr``)."""
        return json.dumps(asdict(self) | {"ok": self.ok}, default=repr, sort_keys=True)
