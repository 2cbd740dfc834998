"""A real Ray cluster of 1 to 4 nodes on this machine, started and stopped by PID.

The head runs on 127.0.0.2, the second node (``nodes=2``, the default) on 127.0.0.3, a third
and fourth on 127.0.0.4 and 127.0.0.5 (Ray
rewrites 127.0.0.1 to the host's routable address; other loopback addresses are kept), each a
``ray start --block`` in its own session. No dashboard, no usage stats, a small object store.
Stopping never runs ``ray stop`` (which ends every Ray process on the machine, other users'
too): it records every process the ``ray start`` commands started (their process groups and
every descendant, Ray's worker processes included), SIGTERMs the groups, then SIGKILLs whatever
of those is left, by PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY_BIN = Path(sys.executable).with_name("ray")
HEAD_IP = "127.0.0.2"
NODE_IP = "127.0.0.3"
NODE2_IP = "127.0.0.4"
NODE3_IP = "127.0.0.5"
NODE4_IP = "127.0.0.6"
#: The nodes' names and addresses, in start order.
NODES = (
    ("head", HEAD_IP),
    ("node", NODE_IP),
    ("node2", NODE2_IP),
    ("node3", NODE3_IP),
    ("node4", NODE4_IP),
)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, pgid, state) of every process (from /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def live(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    table = _proc_table()
    return {p for p in pids if p in table and table[p][2] != "Z"}


class LocalRayCluster:
    """``with LocalRayCluster(env) as cluster:`` -> ``cluster.address`` (``127.0.0.2:PORT``);
    a driver needs ``cluster.auth_env`` in its environment."""

    def __init__(
        self,
        env: dict[str, str],
        num_cpus: int = 3,
        timeout_s: float = 180.0,
        nodes: int = 2,
        head_cpus: int | None = None,
    ) -> None:
        #: Ray's token authentication off for this loopback-only cluster: by default `ray
        #: start --head` turns it on with the token in ~/.ray/auth_token, a file every Ray
        #: user of this machine shares (and may rewrite while the cluster runs).
        self.auth_env = {"RAY_AUTH_MODE": "disabled"}
        self.env = {
            **env,
            **self.auth_env,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_agent_register_timeout_ms": "180000",
            "RAY_raylet_start_wait_time_s": "180",
            "RAY_DEDUP_LOGS": "0",
        }
        self.num_cpus = num_cpus
        self.head_cpus = num_cpus if head_cpus is None else head_cpus
        self.timeout_s = timeout_s
        self.nodes = nodes
        # Short: Ray's Unix sockets live under it (108-byte path limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="psray-", dir="/tmp"))
        self.port = free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.seen: set[int] = set()  # every process of the cluster ever observed
        self.start_s: dict[str, float] = {}

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.temp_dir / f"{name}.log", "wb")  # closed once the process has it
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [str(RAY_BIN), "start", "--block", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        deadline = t0 + self.timeout_s
        while b"Ray runtime started" not in (self.temp_dir / f"{name}.log").read_bytes():
            if proc.poll() is not None:
                raise RuntimeError(f"ray start ({name}) exited {proc.returncode}: {self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray start ({name}) not up in {self.timeout_s} s")
            time.sleep(0.2)
        self.start_s[name] = round(time.monotonic() - t0, 2)
        self.track()

    def log(self, name: str) -> str:
        return (self.temp_dir / f"{name}.log").read_text(errors="replace")[-3000:]

    def start(self, attempts: int = 2) -> LocalRayCluster:
        """Start the nodes; under heavy load Ray's own start can fail (a raylet that gave
        up waiting for its agents), so a failed start is stopped and tried once more."""
        for attempt in range(attempts):
            try:
                self._start("head", ["--head", f"--port={self.port}", *self._node_args(HEAD_IP)])
                for name, ip in NODES[1 : self.nodes]:
                    self._start(name, [f"--address={self.address}", *self._node_args(ip)])
                return self
            except RuntimeError as exc:
                left = self.stop()
                if attempt == attempts - 1 or left:
                    raise
                print(f"\n[ray] cluster start failed, trying again: {exc}", flush=True)
                self.procs = []
                self.port = free_port(HEAD_IP)
                self.address = f"{HEAD_IP}:{self.port}"
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _node_args(self, ip: str) -> list[str]:
        """Every port given (none left for a node to pick and publish in a file the raylet
        waits for: under load that wait can time out), no dashboard, no usage stats."""
        args = [
            f"--node-ip-address={ip}",
            f"--num-cpus={self.head_cpus if ip == HEAD_IP else self.num_cpus}",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            f"--dashboard-agent-grpc-port={free_port(ip)}",
            f"--dashboard-agent-listen-port={free_port(ip)}",
            f"--metrics-export-port={free_port(ip)}",
            f"--runtime-env-agent-port={free_port(ip)}",
        ]
        if ip == HEAD_IP:
            args += [
                f"--ray-client-server-port={free_port(ip)}",
                "--include-dashboard=false",
                f"--temp-dir={self.temp_dir / 'ray'}",
            ]
        return args

    def track(self) -> set[int]:
        """Record every live process of the cluster: the ``ray start`` process groups and all
        their descendants (Ray's workers run in groups of their own)."""
        table = _proc_table()
        roots = {p.pid for p in self.procs}
        mine = {pid for pid, (_, pgid, _) in table.items() if pgid in roots} | roots
        grew = True
        while grew:
            more = {pid for pid, (ppid, _, _) in table.items() if ppid in mine} - mine
            grew = bool(more)
            mine |= more
        self.seen |= {p for p in mine if table.get(p, (0, 0, "Z"))[2] != "Z"}
        return mine

    def kill_node(self, ip: str) -> set[int]:
        """Lose the node at ``ip`` at once: SIGKILL its ``ray start`` process group and every
        descendant (raylet, its agents, the Ray workers on it); returns the PIDs killed."""
        name = dict((addr, n) for n, addr in NODES)[ip]
        proc = self.procs[[n for n, _ in NODES].index(name)]
        table = _proc_table()
        mine = {pid for pid, (_, pgid, _) in table.items() if pgid == proc.pid} | {proc.pid}
        grew = True
        while grew:
            more = {pid for pid, (ppid, _, _) in table.items() if ppid in mine} - mine
            grew = bool(more)
            mine |= more
        for pid in mine:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        return mine

    def stop(self, timeout_s: float = 20.0) -> set[int]:
        """Stop every process of the cluster by PID; returns those still alive (none, unless
        something is badly wrong)."""
        self.track()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s / 2
        while live(self.seen) and time.monotonic() < deadline:
            self.track()
            time.sleep(0.2)
        for pid in live(self.seen):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s / 2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + timeout_s / 2
        while live(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        return live(self.seen)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
