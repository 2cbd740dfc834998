"""A user's training script as the job of Ray worker tasks (:class:`ScriptJob`)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict


class ScriptFailed(RuntimeError):
    """A worker's script exited with a status other than 0 (the message holds its last
    lines of output)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(
        self,
    ) -> tuple[type[ScriptFailed], tuple[str, int]]:  # travels back to the driver by pickle
        return (ScriptFailed, (str(self), self.exit_code))


class ScriptResult(TypedDict):
    """What a worker's script gives back when it exits with 0: that status and its last
    lines of output."""

    exit_code: int
    output: list[str]


@dataclass(frozen=True)
class ScriptJob:
    """Worker tasks that each run a user's training script, unchanged, as ``paramserver run``
    starts it: ``python -u SCRIPT ARGS`` (this node's interpreter) for a ``.py`` file, else
    ``SCRIPT ARGS``, with the environment of :mod:`paramserver.worker_client.env` set
    (``PARAMSERVER_ADDRESS``, ``PARAMSERVER_SHARD_ADDRESSES``, ``WORKER_INDEX``,
    ``NUM_WORKERS``, ``WORKER_NAME`` = ``<job name>-worker-<index>``,
    ``PARAMSERVER_REPLACE=1``) over the Ray worker's own and :attr:`env`. So the script reads
    the cluster with ``ps.connect_sync_from_env()`` or a
    :class:`~paramserver.integrations.torch.ServerOptimizer`.

    Each line the script prints is printed by the task as ``[worker I] line`` (the driver shows
    it with ``log_to_driver``). The script dies with its task (Linux: the parent-death
    signal), so a cancelled or killed task leaves no process behind. A worker's result is
    ``{"exit_code": 0, "output": [its last lines]}``; a status other than 0 fails the task
    with :class:`ScriptFailed` (retried by Ray up to ``worker_max_retries`` times; the retry
    replaces the dead registration under the same name and resumes its progress).

    Attributes:
        script: Path of the script, as every node sees it (an absolute path: the same file on
            every node, e.g. a shared filesystem or the same image).
        args: Its arguments.
        env: More environment variables of the script (a token file, TLS files...).
        cwd: Its working directory (default: the Ray worker's).
        output_lines: How many of its last lines each worker's result keeps.
    """

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    output_lines: int = 20

    def argv(self) -> list[str]:
        """The command line on this node."""
        if self.script.endswith(".py"):
            return [sys.executable, "-u", self.script, *self.args]
        return [self.script, *self.args]

    def environment(
        self, base: Mapping[str, str], addresses: Sequence[str], index: int, num_workers: int,
        worker_name: str,
    ) -> dict[str, str]:  # fmt: skip
        """The script's environment: ``base``, then :attr:`env`, then the launcher's
        variables."""
        from paramserver.worker_client import env as names

        out = {**base, **self.env}
        out[names.ADDRESS_ENV] = addresses[0]
        out[names.SHARD_ADDRESSES_ENV] = ",".join(addresses)
        out[names.WORKER_INDEX_ENV] = str(index)
        out[names.NUM_WORKERS_ENV] = str(num_workers)
        out[names.WORKER_NAME_ENV] = worker_name
        out[names.REPLACE_ENV] = "1"
        out["PYTHONUNBUFFERED"] = "1"
        return out

    def run(
        self, addresses: Sequence[str], index: int, num_workers: int, worker_name: str
    ) -> ScriptResult:
        """Run the script as worker ``index`` to its end.

        Raises:
            ScriptFailed: it exited with a status other than 0 (or was killed by a signal).
        """
        env = self.environment(os.environ, addresses, index, num_workers, worker_name)
        last: collections.deque[str] = collections.deque(maxlen=max(1, self.output_lines))
        proc = subprocess.Popen(
            self.argv(),
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        try:
            assert proc.stdout is not None
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                last.append(line)
                print(f"[worker {index}] {line}", flush=True)
            code = proc.wait()
        finally:  # cancelled (KeyboardInterrupt) or failed here: the script goes too
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if code != 0:
            status = f"signal {-code}" if code < 0 else f"status {code}"
            tail = "\n".join(last)
            raise ScriptFailed(
                f"{' '.join(self.argv()[-len(self.args) - 1 :])} (worker {index}) exited with "
                f"{status}; its last lines:\n{tail}",
                128 - code if code < 0 else code,
            )
        return {"exit_code": 0, "output": list(last)}


def _die_with_parent() -> None:
    """In the script's process before exec: SIGKILL it when its parent (the Ray worker) dies
    (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
