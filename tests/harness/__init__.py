"""The suite's harness: real server and worker processes (:mod:`.processes`), in-process
servers and clusters (:mod:`.clusters`), and the one polling loop (:mod:`.polling`)."""

from .clusters import address_of, job_params, run_job, running_cluster, running_server
from .polling import eventually
from .processes import (
    JsonWorker,
    PlanWorker,
    ScriptProcess,
    ServerProcess,
    free_port,
    rss_bytes,
    status,
    wait_serving,
)

__all__ = [
    "JsonWorker",
    "PlanWorker",
    "ScriptProcess",
    "ServerProcess",
    "address_of",
    "eventually",
    "free_port",
    "job_params",
    "rss_bytes",
    "run_job",
    "running_cluster",
    "running_server",
    "status",
    "wait_serving",
]
