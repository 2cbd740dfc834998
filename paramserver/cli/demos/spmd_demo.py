"""``paramserver spmd-demo``: the SPMD block-transfer layer end to end.

Two instances, A and B, of ``ranks`` rank servers each. By default the demo starts them itself
as real subprocesses on 127.0.0.1 (ephemeral ports, one shared object store). Given
``instance_a`` / ``instance_b`` (``--instance-a HOST:PORT,HOST:PORT`` ...; rank order) it drives
rank servers that are already running instead — the docker-compose services — after polling
their gRPC health service until every one answers SERVING (bounded by ``wait_s``). On every rank:

1. fills A's G2 blocks ``[0, n)`` with known bytes (seeded per run, distinct per rank and
   block);
2. offloads them A.G2 -> A.G3 (local disk) and A.G2 -> G4 (object tier, keyed by the chained
   sequence hashes of a synthetic prompt whose parent hash is the run seed, so a rerun against
   the same object store never finds an earlier run's objects);
3. connects B to A and onboards into B.G2: from A.G2 through shared memory (when B's rank can
   map A's segment; otherwise the rank server falls back to gRPC, and the report names the path
   actually taken), from A.G2 through a gRPC stream, from A.G3 through a gRPC stream, and from
   the object tier;
4. reads every destination block back and compares its BLAKE2b digest with the digest of the
   bytes written in step 1;
5. prints bytes moved and GB/s per path; exits 0 only when every byte matched.

The object tier is a store shared by the instances (docs/spmd.md: keys
``"{rank}/{sequence_hash}"``),
so rank i of B reads the objects rank i of A wrote only when both were started with the same
``--object-dir`` (the compose file mounts one volume for all four). The demo checks that B sees
every key before onboarding from it.

Exit status: 0 every byte verified; 1 a mismatch, a failed transfer, or servers that never
answered; 2 servers that cannot hold the demo (too few blocks, differing block formats, no
object tier, same instance id).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from paramserver.api.v1 import spmd_pb2
from paramserver.cli.demos.rank_launcher import RankServerCluster, wait_serving
from paramserver.errors import ParamServerError
from paramserver.security.tls import ClientSecurity
from paramserver.serving.bootstrap import run_loop
from paramserver.spmd.group import ObjectKeys, SpmdParallelWorkers
from paramserver.spmd.hashing import sequence_hashes
from paramserver.spmd.layout import Layout, Tier, parse_layout_spec
from paramserver.spmd.notification import TransferCompleteNotification, TransferResult

__all__ = ["DEFAULT_LAYOUT", "capacity_problems", "run_demo"]

DEFAULT_LAYOUT = "num_layers=4,outer_dim=2,page_size=16,inner_dim=128,dtype=float16"
"""Block format of the rank servers the demo starts itself (32 KiB blocks)."""

_RANGES = ("shm", "grpc", "disk", "object")

ONBOARD_PATHS = len(_RANGES)
"""Destination ranges in B.G2 (shared memory, gRPC, disk, object), each ``n`` blocks."""

_PATH_LABELS = {
    "shared-memory": "shared memory",
    "grpc": "gRPC stream",
    "object": "object store",
    "local": "local",
}


def _block_bytes(seed: int, rank: int, n: int, bytes_per_block: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return rng.integers(0, 256, size=(n, bytes_per_block), dtype=np.uint8)


def _digests(blocks: np.ndarray) -> list[str]:
    return [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in blocks]


def _layouts(md: spmd_pb2.RankMetadata) -> dict[Tier, Layout]:
    return {Tier.parse(int(spec.tier)): Layout.from_proto(spec) for spec in md.layouts}


def capacity_problems(
    a: Sequence[spmd_pb2.RankMetadata],
    b: Sequence[spmd_pb2.RankMetadata],
    blocks: int,
    expected_layout: Layout | None = None,
) -> list[str]:
    """Why instances A and B cannot run the demo with ``blocks`` blocks per rank (empty: they can).

    Needs, on every rank: A.G2 and A.G3 of at least ``blocks`` blocks, B.G2 of at least
    ``ONBOARD_PATHS * blocks``, one block format everywhere (and equal to ``expected_layout``
    when given), an object tier; A and B with the same rank count and distinct instance ids.

    Args:
        a: metadata of A's ranks, by rank.
        b: metadata of B's ranks, by rank.
        blocks: blocks moved per rank.
        expected_layout: block format the caller asked for (``num_blocks`` ignored).

    Returns:
        One human-readable reason per problem.
    """
    problems: list[str] = []
    if len(a) != len(b):
        problems.append(f"instance A has {len(a)} ranks but B has {len(b)}; rank i pairs with i")
    if a and b and a[0].instance_id == b[0].instance_id:
        problems.append(f"both instances report the instance id {a[0].instance_id!r}")
    needs = {
        "A": ((Tier.G2, blocks), (Tier.G3, blocks)),
        "B": ((Tier.G2, ONBOARD_PATHS * blocks),),
    }
    reference = expected_layout
    for name, group in (("A", a), ("B", b)):
        for md in group:
            where = f"{name} rank {md.rank} ({md.address})"
            if not md.object_tier:
                problems.append(f"{where}: no object tier (G4)")
            layouts = _layouts(md)
            for tier, count in needs[name]:
                layout = layouts.get(tier)
                if layout is None:
                    problems.append(f"{where}: tier {tier.name} not registered")
                    continue
                if layout.num_blocks < count:
                    problems.append(
                        f"{where}: {tier.name} holds {layout.num_blocks} blocks, the demo needs "
                        f"{count} (--blocks {blocks})"
                    )
                if reference is None:
                    reference = layout
                elif not layout.same_block_format(reference):
                    problems.append(
                        f"{where}: {tier.name} block format {layout.block_shape} {layout.dtype} "
                        f"differs from {reference.block_shape} {reference.dtype}"
                    )
    return problems


async def _demo(
    a_addr: Sequence[str],
    b_addr: Sequence[str],
    n: int,
    json_lines: bool,
    *,
    expected_layout: Layout | None,
    wait_s: float,
    seed: int,
    security: ClientSecurity | None = None,
) -> int:
    await wait_serving([*a_addr, *b_addr], timeout_s=wait_s, security=security)
    # (path name, bytes, seconds, transports actually used)
    rows: list[tuple[str, int, float, list[str]]] = []

    async def timed(
        name: Callable[[list[str]], str],
        start: Callable[[], Awaitable[TransferCompleteNotification]],
    ) -> TransferResult:
        t0 = time.perf_counter()
        notification = await start()
        result = await notification
        elapsed = time.perf_counter() - t0
        paths = sorted({r.path for r in result.results.values()})
        rows.append((name(paths), result.bytes_moved, elapsed, paths))
        return result

    def label(paths: list[str]) -> str:
        return ", ".join(_PATH_LABELS.get(p, p) for p in paths)

    async with (
        SpmdParallelWorkers(a_addr, default_timeout_s=60, security=security) as a,
        SpmdParallelWorkers(b_addr, default_timeout_s=60, security=security) as b,
    ):
        a_md, b_md = await a.export_metadata(), await b.export_metadata()
        problems = capacity_problems(a_md, b_md, n, expected_layout)
        if problems:
            for problem in problems:
                print(f"spmd-demo: {problem}", file=sys.stderr)
            return 2
        ranks = a.worker_count()
        layout = a.layouts(0)[Tier.G2]
        bpb = layout.bytes_per_block
        expected = {r: _block_bytes(seed, r, n, bpb) for r in range(ranks)}
        digests = {r: _digests(expected[r]) for r in range(ranks)}
        ids = list(range(n))

        t0 = time.perf_counter()
        await asyncio.gather(*(a.write_blocks(r, Tier.G2, ids, expected[r]) for r in range(ranks)))
        rows.append(
            ("client->A.G2 fill (gRPC stream)", ranks * n * bpb, time.perf_counter() - t0, ["grpc"])
        )

        await timed(
            lambda _: "A.G2->A.G3 local offload (disk)",
            lambda: a.execute_local_transfer(Tier.G2, Tier.G3, ids, ids),
        )
        tokens = np.arange(n * layout.page_size, dtype=np.int64)
        hashes = sequence_hashes(tokens, layout.page_size, parent_hash=seed)
        await timed(
            lambda _: "A.G2->G4 offload (object store)",
            lambda: a.execute_remote_offload(Tier.G2, ids, ObjectKeys(hashes)),
        )

        source = a.instance_id
        await b.connect_remote(source, a_md)
        ranges = {name: list(range(k * n, (k + 1) * n)) for k, name in enumerate(_RANGES)}
        await timed(
            lambda paths: (
                "A.G2->B.G2 onboard (shared memory)"
                if paths == ["shared-memory"]
                else f"A.G2->B.G2 onboard ({label(paths)}; shared memory not mappable)"
            ),
            lambda: b.execute_remote_onboard_for_instance(
                source, Tier.G2, ids, Tier.G2, ranges["shm"]
            ),
        )
        await timed(
            lambda _: "A.G2->B.G2 onboard (gRPC stream)",
            lambda: b.execute_remote_onboard_for_instance(
                source, Tier.G2, ids, Tier.G2, ranges["grpc"], allow_shared_memory=False
            ),
        )
        await timed(
            lambda _: "A.G3->B.G2 onboard (disk, gRPC stream)",
            lambda: b.execute_remote_onboard_for_instance(
                source, Tier.G3, ids, Tier.G2, ranges["disk"]
            ),
        )
        missing = [p for p in await b.has_blocks(hashes) if not p.present]
        if missing:
            print(
                f"spmd-demo: FAILED: instance B's ranks see {len(hashes) - len(missing)} of the "
                f"{len(hashes)} objects A's ranks offloaded; start both instances with one "
                "--object-dir (a shared volume)",
                file=sys.stderr,
            )
            return 1
        await timed(
            lambda _: "G4->B.G2 onboard (object store)",
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
        rows.append(
            ("read back for verification (gRPC)", read_bytes, time.perf_counter() - t0, ["grpc"])
        )

    width = max(len(name) for name, _, _, _ in rows)
    config = {
        "ranks": ranks,
        "blocks": n,
        "bytes_per_block": bpb,
        "dtype": layout.dtype,
        "instance_a": list(a_addr),
        "instance_b": list(b_addr),
        "run_seed": seed,
    }
    if not json_lines:
        print(
            f"spmd-demo: 2 instances x {ranks} ranks, {n} blocks/rank of {bpb} bytes "
            f"({layout.block_shape} {layout.dtype}); A at {','.join(a_addr)}, "
            f"B at {','.join(b_addr)}; run seed {seed}"
        )
    for name, moved, elapsed, paths in rows:
        gbps = moved / elapsed / 1e9 if elapsed > 0 else float("inf")
        if json_lines:
            line = {
                **config,
                "path": name,
                "transport": paths,
                "bytes": moved,
                "seconds": elapsed,
                "gb_per_s": gbps,
            }
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
    layout_text: str | None = None,
    ranks: int = 2,
    work_dir: Path | None = None,
    json_lines: bool = False,
    loop: str = "uvloop",
    instance_a: Sequence[str] | None = None,
    instance_b: Sequence[str] | None = None,
    wait_s: float = 60.0,
    security: ClientSecurity | None = None,
) -> int:
    """Run the demo; returns the process exit status (0 = every byte verified).

    Args:
        blocks: blocks moved per rank.
        layout_text: block format; the demo's own rank servers use it (default
            :data:`DEFAULT_LAYOUT`); existing rank servers must match it when it is given.
        ranks: ranks per instance when the demo starts its own rank servers.
        work_dir: where its own rank servers keep files (default: a temporary directory).
        json_lines: one JSON object per path instead of a table.
        loop: ``"uvloop"`` or ``"asyncio"``.
        instance_a: ``host:port`` of A's existing rank servers in rank order (with
            ``instance_b``); ``None`` starts rank servers here.
        instance_b: the same for B.
        wait_s: how long to poll existing rank servers until they answer SERVING, seconds.
        security: TLS / token towards existing rank servers (an admin token when they check
            tokens: connecting the instances imports metadata).
    """
    if (instance_a is None) != (instance_b is None):
        raise ValueError("give both instance_a and instance_b, or neither")
    seed = random.SystemRandom().getrandbits(63)

    def drive(a_addr: Sequence[str], b_addr: Sequence[str], layout: Layout | None) -> int:
        coro = _demo(
            a_addr,
            b_addr,
            blocks,
            json_lines,
            expected_layout=layout,
            wait_s=wait_s,
            seed=seed,
            security=security,
        )
        try:
            return int(run_loop(coro, use_uvloop=loop == "uvloop"))
        except (ParamServerError, TimeoutError) as exc:
            message = exc.message if isinstance(exc, ParamServerError) else str(exc)
            print(f"spmd-demo: FAILED: {message}", file=sys.stderr)
            return 1

    if instance_a is not None and instance_b is not None:
        return drive(
            instance_a, instance_b, parse_layout_spec(layout_text) if layout_text else None
        )
    layout = parse_layout_spec(layout_text or DEFAULT_LAYOUT)
    base = work_dir if work_dir is not None else Path(tempfile.mkdtemp(prefix="spmd-demo-"))
    try:
        with RankServerCluster(
            base, layout=layout, host_blocks=ONBOARD_PATHS * blocks, disk_blocks=blocks
        ) as cluster:
            cluster.spawn_instance("A", ranks)
            cluster.spawn_instance("B", ranks)
            cluster.wait_ready(timeout_s=60)
            return drive(cluster.addresses("A"), cluster.addresses("B"), layout)
    finally:
        if work_dir is None:
            shutil.rmtree(base, ignore_errors=True)
