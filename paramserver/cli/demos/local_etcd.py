"""Start a private etcd on 127.0.0.1 for a local cluster's failover: :class:`LocalEtcd`.

etcd decides which replica of a shard is primary (:mod:`paramserver.server.election`). Debian
packages it as ``etcd-server`` (``apt-get install etcd-server``). ``LocalEtcd`` runs one member
on free loopback ports with a temporary data directory, with a short election timeout so a
lease may be 1 s, and removes everything on exit::

    with LocalEtcd() as etcd, local_cluster(
        shards=2, replicas=2, election_endpoints=etcd.endpoint, election_ttl_s=1
    ) as cluster:
        ...
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from paramserver.closing import Closing
from paramserver.errors import Unavailable

__all__ = ["LocalEtcd", "etcd_binary"]


def etcd_binary() -> str | None:
    """The ``etcd`` executable on PATH (or Debian's /usr/bin/etcd), or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


class LocalEtcd(Closing):
    """One etcd member on free 127.0.0.1 ports, for one ``with`` block.

    Args:
        start_timeout_s: How long etcd may take to answer (seconds).

    Attributes:
        endpoint: ``127.0.0.1:<client port>`` once started.
        process: The etcd process.

    Raises:
        Unavailable: no etcd binary, or it did not answer in time (UNAVAILABLE).
    """

    def __init__(self, *, start_timeout_s: float = 30.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.endpoint = ""
        self.process: subprocess.Popen[bytes] | None = None
        self._tmp: str | None = None

    def start(self) -> LocalEtcd:
        binary = etcd_binary()
        if binary is None:
            raise Unavailable("no etcd binary (Debian: apt-get install etcd-server)")
        self._tmp = tempfile.mkdtemp(prefix="paramserver-etcd-")
        client, peer = _free_ports(2)
        self.endpoint = f"127.0.0.1:{client}"
        cmd = [
            binary,
            "--name",
            "local",
            "--data-dir",
            str(Path(self._tmp) / "data"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"local=http://127.0.0.1:{peer}",
            # Leases of 1 s (etcd's minimum TTL is 1.5 x the election timeout).
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
        ]
        log = open(Path(self._tmp) / "etcd.log", "wb")
        try:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                req = urllib.request.Request(
                    f"http://{self.endpoint}/v3/kv/range",
                    data=json.dumps({"key": "AA=="}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=1):
                    return self
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"etcd did not answer on {self.endpoint}")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def in_sync(self, prefix: str, shard: int) -> list[int]:
        """The replicas of ``shard`` that etcd lists as holding every acknowledged record
        (those that may take over), under the cluster's ``election_prefix``."""
        from paramserver.server.election import Etcd

        got = Etcd((self.endpoint,))._post_sync(
            "/v3/kv/range", {"key": _b64(f"{prefix.rstrip('/')}/shard-{shard}/sync")}
        )
        kvs = got.get("kvs") or []
        if not kvs:
            return []
        return sorted(json.loads(base64.b64decode(kvs[0].get("value", ""))))

    open = start
    close = stop


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (held until all are read)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
