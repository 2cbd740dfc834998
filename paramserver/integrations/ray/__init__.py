"""paramserver on a Ray cluster: shards as restartable actors, workers as tasks.

Needs the ``ray`` extra (``pip install 'paramserver[ray]'``). Usage, from a process connected
to the cluster (``ray.init(address=...)``)::

    from paramserver.cli.demos.digits import DigitsJob
    from paramserver.integrations.ray import RayJobConfig, launch

    server = {"consistency": "ssp", "staleness": 2}  # ServerConfig fields of every shard
    config = RayJobConfig(num_shards=2, num_workers=4, server=server)
    result = launch(config, DigitsJob(epochs=10))
    print(result.ok, result.metrics["test_accuracy"])

or with a function of one's own, run by every worker task::

    def train(client, worker_index, num_workers):  # client: a SyncWorkerClient
        ...

    launch(RayJobConfig(num_workers=8), train)

or a training script, unchanged, as ``paramserver run`` would start it (the same environment)::

    launch(RayJobConfig(num_workers=4), ScriptJob("/shared/train.py", ("--epochs", "3")))

The command line is ``paramserver ray-launch``; docs/engines.md has the whole story.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, imported on first use (``ray`` is imported then)
    from paramserver.integrations.ray.placement import (
        MANAGED_SERVER_FIELDS,
        ClusterJob,
        RayJobConfig,
        RayShardGroup,
        TrainFunction,
        WorkerJob,
        launch,
    )
    from paramserver.integrations.ray.results import JobResult, WorkerOutcome
    from paramserver.integrations.ray.script_job import ScriptFailed, ScriptJob
    from paramserver.integrations.ray.shard_actor import ShardActor, ShardInfo

__all__ = [
    "MANAGED_SERVER_FIELDS",
    "ClusterJob",
    "JobResult",
    "RayJobConfig",
    "RayShardGroup",
    "ScriptFailed",
    "ScriptJob",
    "ShardActor",
    "ShardInfo",
    "TrainFunction",
    "WorkerJob",
    "WorkerOutcome",
    "launch",
]


def __getattr__(name: str) -> object:
    """Import :mod:`paramserver.integrations.ray.placement` (and so ``ray``) on first use, so that
    ``paramserver.cli.ray_launch`` and ``paramserver --help`` work without the ``ray`` extra."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        launcher = importlib.import_module("paramserver.integrations.ray.placement")
    except ImportError as exc:
        if exc.name != "ray" and not str(exc.name).startswith("ray."):
            raise
        raise ModuleNotFoundError(
            f"paramserver.integrations.ray needs Ray: pip install 'paramserver[ray]' ({exc})",
            name=exc.name,
        ) from exc
    return getattr(launcher, name)
