"""``paramserver spmd-demo``: the SPMD block-transfer layer end to end on 127.0.0.1.

Starts two instances, A and B, of ``ranks`` rank servers each as real subprocesses (ephemeral
ports, one shared object store), then on every rank:

1. fills A's G2 blocks ``[0, n)`` with known bytes (seeded, distinct per rank and block);
2. offloads them A.G2 -> A.G3 (local disk) and A.G2 -> G4 (object tier, keyed by the chained
   sequence hashes of a synthetic prompt);
3. connects B to A and onboards into B.G2: from A.G2 through shared memory, from A.G2 through a
   gRPC stream, from A.G3 through a gRPC stream, and from the object tier;
4. reads every destination block back and compares its BLAKE2b digest with the digest of the
   bytes written in step 1;
5. prints bytes moved and GB/s per path; exits 0 only when every byte matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from paramserver.spmd.cli import run_event_loop
from paramserver.spmd.hashing import sequence_hashes
from paramserver.spmd.launcher import RankServerCluster
from paramserver.spmd.layout import Layout, Tier, parse_layout_spec
from paramserver.spmd.notification import TransferCompleteNotification
from paramserver.spmd.workers import ObjectKeys, SpmdParallelWorkers

__all__ = ["run_demo"]


def _block_bytes(rank: int, n: int, bytes_per_block: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(0, 256, size=(n, bytes_per_block), dtype=np.uint8)


def _digests(blocks: np.ndarray) -> list[str]:
    return [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in blocks]


async def _demo(
    cluster: RankServerCluster, layout: Layout, n: int, ranks: int, json_lines: bool
) -> int:
    bpb = layout.bytes_per_block
    a_addr, b_addr = cluster.addresses("A"), cluster.addresses("B")
    rows: list[tuple[str, int, float]] = []

    async def timed(
        name: str, start: Callable[[], Awaitable[TransferCompleteNotification]]
    ) -> None:
        t0 = time.perf_counter()
        notification = await start()
        result = await notification
        elapsed = time.perf_counter() - t0
        rows.append((name, result.bytes_moved, elapsed))

    async with (
        SpmdParallelWorkers(a_addr, default_timeout_s=60) as a,
        SpmdParallelWorkers(b_addr, default_timeout_s=60) as b,
    ):
        expected = {r: _block_bytes(r, n, bpb) for r in range(ranks)}
        digests = {r: _digests(expected[r]) for r in range(ranks)}
        ids = list(range(n))

        t0 = time.perf_counter()
        await asyncio.gather(*(a.write_blocks(r, Tier.G2, ids, expected[r]) for r in range(ranks)))
        rows.append(("client->A.G2 fill (gRPC stream)", ranks * n * bpb, time.perf_counter() - t0))

        await timed(
            "A.G2->A.G3 local offload (disk)",
            lambda: a.execute_local_transfer(Tier.G2, Tier.G3, ids, ids),
        )
        tokens = np.arange(n * layout.page_size, dtype=np.int64)
        hashes = sequence_hashes(tokens, layout.page_size)
        await timed(
            "A.G2->G4 offload (object store)",
            lambda: a.execute_remote_offload(Tier.G2, ids, ObjectKeys(hashes)),
        )

        await b.connect_remote("A", await a.export_metadata())
        ranges = {
            "shm": list(range(0, n)),
            "grpc": list(range(n, 2 * n)),
            "disk": list(range(2 * n, 3 * n)),
            "object": list(range(3 * n, 4 * n)),
        }
        await timed(
            "A.G2->B.G2 onboard (shared memory)",
            lambda: b.execute_remote_onboard_for_instance(
                "A", Tier.G2, ids, Tier.G2, ranges["shm"]
            ),
        )
        await timed(
            "A.G2->B.G2 onboard (gRPC stream)",
            lambda: b.execute_remote_onboard_for_instance(
                "A", Tier.G2, ids, Tier.G2, ranges["grpc"], allow_shared_memory=False
            ),
        )
        await timed(
            "A.G3->B.G2 onboard (disk, gRPC stream)",
            lambda: b.execute_remote_onboard_for_instance(
                "A", Tier.G3, ids, Tier.G2, ranges["disk"]
            ),
        )
        await timed(
            "G4->B.G2 onboard (object store)",
            lambda: b.execute_remote_onboard(ObjectKeys(hashes), Tier.G2, ranges["object"]),
        )

        mismatches = 0
        checked = 0
        t0 = time.perf_counter()
        for r in range(ranks):
            sources = {"A.G3": await a.read_blocks(r, Tier.G3, ids)}
            for name, dst in ranges.items():
                sources[f"B.G2[{name}]"] = await b.read_blocks(r, Tier.G2, dst)
            for name, arr in sources.items():
                got = _digests(np.ascontiguousarray(arr).view(np.uint8).reshape(n, bpb))
                for k, (g, e) in enumerate(zip(got, digests[r], strict=True)):
                    checked += 1
                    if g != e:
                        mismatches += 1
                        print(f"MISMATCH rank {r} {name} block {k}: {g} != {e}")
        read_bytes = ranks * (len(ranges) + 1) * n * bpb
        rows.append(("read back for verification (gRPC)", read_bytes, time.perf_counter() - t0))

    width = max(len(name) for name, _, _ in rows)
    config = {"ranks": ranks, "blocks": n, "bytes_per_block": bpb, "dtype": layout.dtype}
    if not json_lines:
        print(
            f"spmd-demo: 2 instances x {ranks} ranks, {n} blocks/rank of {bpb} bytes "
            f"({layout.block_shape} {layout.dtype})"
        )
    for name, moved, elapsed in rows:
        gbps = moved / elapsed / 1e9 if elapsed > 0 else float("inf")
        if json_lines:
            line = {**config, "path": name, "bytes": moved, "seconds": elapsed, "gb_per_s": gbps}
            print(json.dumps(line))
        else:
            print(
                f"  {name:<{width}}  {moved / 2**20:8.2f} MiB  {elapsed * 1000:8.1f} ms  "
                f"{gbps:6.3f} GB/s"
            )
    if json_lines:
        print(json.dumps({**config, "verified_blocks": checked, "mismatches": mismatches}))
    if mismatches:
        print(f"FAILED: {mismatches} of {checked} blocks differ")
        return 1
    if not json_lines:
        print(f"OK: {checked} blocks verified by BLAKE2b digest, every byte matches")
    return 0


def run_demo(
    *,
    blocks: int = 128,
    layout_text: str = "",
    ranks: int = 2,
    work_dir: Path | None = None,
    json_lines: bool = False,
    loop: str = "uvloop",
) -> int:
    """Run the demo; returns the process exit status (0 = every byte verified)."""
    layout = parse_layout_spec(layout_text)
    base = work_dir if work_dir is not None else Path(tempfile.mkdtemp(prefix="spmd-demo-"))
    try:
        with RankServerCluster(
            base, layout=layout, host_blocks=4 * blocks, disk_blocks=blocks
        ) as cluster:
            cluster.spawn_instance("A", ranks)
            cluster.spawn_instance("B", ranks)
            cluster.wait_ready(timeout_s=60)
            return int(run_event_loop(_demo(cluster, layout, blocks, ranks, json_lines), loop))
    finally:
        if work_dir is None:
            shutil.rmtree(base, ignore_errors=True)
