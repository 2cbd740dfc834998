"""Unit tests of the pure SPMD validation, planning and merging (no sockets, no event loop)."""

from __future__ import annotations

import itertools
import random

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.errors import InvalidArgument, ParamServerError, WaitTimeout
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.planning import (
    BlockReservations,
    Run,
    Verdict,
    check_local_transfer,
    check_object_transfer,
    check_remote_transfer,
    coalesce_runs,
    expand_per_rank,
    merge_key_results,
    merge_presence,
    server_budget_s,
    split_stream,
)
from paramserver.spmd.transfer_errors import (
    BlocksBusy,
    RankFailures,
    TierNotRegistered,
    TransferFailed,
)

L16 = Layout(num_blocks=16, num_layers=2, outer_dim=2, page_size=8, inner_dim=64)
L8 = Layout(num_blocks=8, num_layers=2, outer_dim=2, page_size=8, inner_dim=64)
OTHER = Layout(num_blocks=16, num_layers=2, outer_dim=2, page_size=8, inner_dim=32)
LAYOUTS = {Tier.G2: L16, Tier.G3: L8}


# --------------------------------------------------------------------------- local transfers

LOCAL_CASES = [
    # (name, src tier, dst tier, src ids, dst ids, ok, reason fragment, error class)
    ("g2->g3 ok", Tier.G2, Tier.G3, [0, 1, 2], [5, 6, 7], True, "", None),
    ("g3->g2 ok", Tier.G3, Tier.G2, [7], [15], True, "", None),
    ("g2->g2 disjoint ok", Tier.G2, Tier.G2, [0, 1], [2, 3], True, "", None),
    ("empty ok", Tier.G2, Tier.G3, [], [], True, "", None),
    ("dup sources ok", Tier.G2, Tier.G3, [1, 1], [2, 3], True, "", None),
    ("unequal lengths", Tier.G2, Tier.G3, [0, 1, 2], [0, 1], False, "3 ids", InvalidArgument),
    ("src out of range", Tier.G2, Tier.G3, [16], [0], False, "out of range [0, 16)", None),
    ("dst out of range", Tier.G2, Tier.G3, [0], [8], False, "out of range [0, 8)", None),
    ("negative id", Tier.G2, Tier.G3, [-1], [0], False, "out of range", None),
    ("dup destinations", Tier.G2, Tier.G3, [0, 1], [3, 3], False, "not unique", None),
    ("overlap same layout", Tier.G2, Tier.G2, [0, 1], [1, 2], False, "overlap", None),
    ("self copy", Tier.G3, Tier.G3, [4], [4], False, "overlap", None),
    ("g4 source", Tier.G4, Tier.G2, [0], [0], False, "never a local-transfer", None),
    ("g4 destination", Tier.G2, Tier.G4, [0], [0], False, "never a local-transfer", None),
    ("g1 absent", Tier.G1, Tier.G2, [0], [0], False, "G1 not registered", TierNotRegistered),
    ("g1 absent dst", Tier.G2, Tier.G1, [0], [0], False, "not registered", TierNotRegistered),
]


@pytest.mark.parametrize(
    ("name", "src", "dst", "src_ids", "dst_ids", "ok", "fragment", "error"),
    LOCAL_CASES,
    ids=[c[0] for c in LOCAL_CASES],
)
def test_check_local_transfer(
    name: str,
    src: Tier,
    dst: Tier,
    src_ids: list[int],
    dst_ids: list[int],
    ok: bool,
    fragment: str,
    error: type[ParamServerError] | None,
) -> None:
    verdict = check_local_transfer(
        src_tier=src, dst_tier=dst, src_ids=src_ids, dst_ids=dst_ids, layouts=LAYOUTS
    )
    assert verdict.ok is ok, verdict.reason
    assert fragment in verdict.reason
    if error is not None:
        assert verdict.error is error
    if not ok:
        with pytest.raises(verdict.error) as info:
            verdict.raise_if_refused("rank 3: ")
        assert info.value.message.startswith("rank 3: ")


def test_unequal_lengths_name_both_counts() -> None:
    verdict = check_local_transfer(
        src_tier=Tier.G2, dst_tier=Tier.G3, src_ids=[0, 1, 2], dst_ids=[0, 1], layouts=LAYOUTS
    )
    assert "3" in verdict.reason and "2" in verdict.reason


def test_block_format_mismatch_refused() -> None:
    verdict = check_local_transfer(
        src_tier=Tier.G2,
        dst_tier=Tier.G3,
        src_ids=[0],
        dst_ids=[0],
        layouts={Tier.G2: L16, Tier.G3: OTHER},
    )
    assert not verdict.ok and "block formats differ" in verdict.reason


def test_not_registered_maps_to_failed_precondition() -> None:
    verdict = check_local_transfer(
        src_tier=Tier.G1, dst_tier=Tier.G2, src_ids=[0], dst_ids=[0], layouts=LAYOUTS
    )
    with pytest.raises(TierNotRegistered) as info:
        verdict.raise_if_refused()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


# --------------------------------------------------------------------------- remote transfers

REMOTE_CASES = [
    # (name, local tier, local ids, remote tier, remote ids, onboard, ok, fragment)
    ("onboard ok", Tier.G2, [0, 1], Tier.G2, [3, 4], True, True, ""),
    ("offload ok", Tier.G2, [0, 1], Tier.G3, [7, 6], False, True, ""),
    ("onboard dup dst", Tier.G2, [0, 0], Tier.G2, [3, 4], True, False, "not unique"),
    ("offload dup dst", Tier.G2, [0, 1], Tier.G3, [6, 6], False, False, "not unique"),
    ("onboard dup src ok", Tier.G2, [0, 1], Tier.G2, [3, 3], True, True, ""),
    ("lengths", Tier.G2, [0, 1, 2], Tier.G2, [3], True, False, "source has 1"),
    ("remote range", Tier.G2, [0], Tier.G3, [8], True, False, "remote (G3)"),
    ("local range", Tier.G2, [16], Tier.G3, [0], True, False, "local (G2)"),
    ("remote g4", Tier.G2, [0], Tier.G4, [0], True, False, "sequence hashes"),
    ("remote g1", Tier.G2, [0], Tier.G1, [0], True, False, "remote tier G1 not registered"),
]


@pytest.mark.parametrize(
    ("name", "ltier", "lids", "rtier", "rids", "onboard", "ok", "fragment"),
    REMOTE_CASES,
    ids=[c[0] for c in REMOTE_CASES],
)
def test_check_remote_transfer(
    name: str,
    ltier: Tier,
    lids: list[int],
    rtier: Tier,
    rids: list[int],
    onboard: bool,
    ok: bool,
    fragment: str,
) -> None:
    verdict = check_remote_transfer(
        local_tier=ltier,
        local_ids=lids,
        local_layouts=LAYOUTS,
        remote_tier=rtier,
        remote_ids=rids,
        remote_layouts=LAYOUTS,
        onboard=onboard,
    )
    assert verdict.ok is ok, verdict.reason
    assert fragment in verdict.reason


def test_remote_format_mismatch() -> None:
    verdict = check_remote_transfer(
        local_tier=Tier.G2,
        local_ids=[0],
        local_layouts=LAYOUTS,
        remote_tier=Tier.G2,
        remote_ids=[0],
        remote_layouts={Tier.G2: OTHER},
        onboard=True,
    )
    assert not verdict.ok and "block formats differ" in verdict.reason


# --------------------------------------------------------------------------- object transfers

OBJECT_CASES = [
    # (name, tier, ids, hashes, into_blocks, object_tier, ok, fragment)
    ("get ok", Tier.G2, [10, 11], [1, 2], True, True, True, ""),
    ("put ok", Tier.G3, [0, 0], [1, 2], False, True, True, ""),
    ("three hashes two ids", Tier.G2, [10, 11], [1, 2, 3], True, True, False, "3 sequence"),
    ("dup hashes", Tier.G2, [10, 11], [5, 5], True, True, False, "sequence hash ids are not"),
    ("dup destinations", Tier.G2, [10, 10], [1, 2], True, True, False, "destination ids"),
    ("out of range", Tier.G3, [8], [1], False, True, False, "out of range"),
    ("hash too big", Tier.G2, [0], [1 << 64], True, True, False, "outside [0, 2**64)"),
    ("no object tier", Tier.G2, [0], [1], True, False, False, "G4 not registered"),
    ("g4 local side", Tier.G4, [0], [1], True, True, False, "cannot be G4"),
    ("g1 absent", Tier.G1, [0], [1], True, True, False, "G1 not registered"),
]


@pytest.mark.parametrize(
    ("name", "tier", "ids", "hashes", "into", "obj", "ok", "fragment"),
    OBJECT_CASES,
    ids=[c[0] for c in OBJECT_CASES],
)
def test_check_object_transfer(
    name: str,
    tier: Tier,
    ids: list[int],
    hashes: list[int],
    into: bool,
    obj: bool,
    ok: bool,
    fragment: str,
) -> None:
    verdict = check_object_transfer(
        tier=tier,
        ids=ids,
        sequence_hashes=hashes,
        layouts=LAYOUTS,
        into_blocks=into,
        object_tier=obj,
    )
    assert verdict.ok is ok, verdict.reason
    assert fragment in verdict.reason


def test_three_hashes_two_ids_names_both_counts() -> None:
    """Case onboard-destination-slots.md: the refusal names both counts."""
    verdict = check_object_transfer(
        tier=Tier.G2,
        ids=[10, 11],
        sequence_hashes=[1, 2, 3],
        layouts=LAYOUTS,
        into_blocks=True,
    )
    assert verdict.reason == "3 sequence hashes but 2 block ids"
    assert verdict.error is InvalidArgument


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([], [], []),
        ([0], [5], [Run(0, 5, 1, 0)]),
        ([0, 1, 2], [5, 6, 7], [Run(0, 5, 3, 0)]),
        ([0, 1, 2], [5, 6, 8], [Run(0, 5, 2, 0), Run(2, 8, 1, 2)]),
        ([0, 2, 3], [5, 6, 7], [Run(0, 5, 1, 0), Run(2, 6, 2, 1)]),
        ([3, 2, 1], [0, 1, 2], [Run(3, 0, 1, 0), Run(2, 1, 1, 1), Run(1, 2, 1, 2)]),
        ([7, 8, 0, 1], [0, 1, 2, 3], [Run(7, 0, 2, 0), Run(0, 2, 2, 2)]),
    ],
)
def test_coalesce_runs_grid(src: list[int], dst: list[int], expected: list[Run]) -> None:
    assert coalesce_runs(src, dst) == expected


def test_coalesce_runs_rejects_unequal() -> None:
    with pytest.raises(InvalidArgument):
        coalesce_runs([1, 2], [1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=40))
def test_coalesce_runs_expands_back_to_the_pairs(pairs: list[tuple[int, int]]) -> None:
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    runs = coalesce_runs(src, dst)
    expanded = [(r.src_start + k, r.dst_start + k) for r in runs for k in range(r.count)]
    assert expanded == pairs
    assert [r.index for r in runs] == sorted(r.index for r in runs)
    for a, b in itertools.pairwise(runs):  # maximal: neighbours could not merge
        last = (a.src_start + a.count - 1, a.dst_start + a.count - 1)
        assert not (b.src_start == last[0] + 1 and b.dst_start == last[1] + 1)


@settings(max_examples=300, deadline=None)
@given(
    bpb=st.integers(1, 64),
    n=st.integers(1, 20),
    data=st.data(),
)
def test_split_stream_covers_the_chunk_exactly(bpb: int, n: int, data: st.DataObject) -> None:
    total = bpb * n
    offset = data.draw(st.integers(0, total))
    length = data.draw(st.integers(0, total - offset))
    pieces = split_stream(offset, length, bpb, n)
    assert sum(p.length_bytes for p in pieces) == length
    pos = offset
    chunk_pos = 0
    for p in pieces:
        assert p.index * bpb + p.offset_in_block_bytes == pos
        assert p.offset_in_chunk_bytes == chunk_pos
        assert 0 < p.length_bytes <= bpb - p.offset_in_block_bytes
        pos += p.length_bytes
        chunk_pos += p.length_bytes


@pytest.mark.parametrize(("offset", "length"), [(-1, 1), (0, 33), (30, 3), (33, 0)])
def test_split_stream_rejects_chunks_outside(offset: int, length: int) -> None:
    with pytest.raises(InvalidArgument):
        split_stream(offset, length, 8, 4)


def test_expand_per_rank() -> None:
    assert expand_per_rank([1, 2], 3, "ids") == [[1, 2], [1, 2], [1, 2]]
    assert expand_per_rank({0: [1], 2: [5, 6]}, 4, "ids") == [[1], [], [5, 6], []]
    with pytest.raises(InvalidArgument, match="ranks \\[4\\]"):
        expand_per_rank({4: [1]}, 4, "ids")
    with pytest.raises(InvalidArgument, match="not an integer"):
        expand_per_rank([1.5], 2, "ids")
    with pytest.raises(InvalidArgument, match="not an integer"):
        expand_per_rank(["x"], 2, "ids")  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("timeout_s", "low", "high"),
    [(0.001, 0.0009, 0.001), (1.0, 0.89, 0.91), (2.0, 1.79, 1.81), (30.0, 29.74, 29.76)],
)
def test_server_budget_is_a_bit_below_the_client_deadline(
    timeout_s: float, low: float, high: float
) -> None:
    budget = server_budget_s(timeout_s)
    assert low <= budget <= high
    assert budget <= timeout_s


# --------------------------------------------------------------------------- reservations


def test_reservations() -> None:
    r = BlockReservations()
    assert r.reserve("a", reads={Tier.G2: [0, 1]}, writes={Tier.G3: [0, 1]}).ok
    # reading what "a" reads is fine, in another tier too
    assert r.reserve("b", reads={Tier.G2: [0, 1]}, writes={Tier.G2: [5]}).ok
    # writing what "a" reads is refused
    v = r.reserve("c", writes={Tier.G2: [1]})
    assert not v.ok and v.error is BlocksBusy and "being read by in-flight command a" in v.reason
    # reading or writing what "a" writes is refused
    assert not r.reserve("d", reads={Tier.G3: [1]}).ok
    assert not r.reserve("e", writes={Tier.G3: [0]}).ok
    # other blocks of the same tier are fine
    assert r.reserve("f", writes={Tier.G3: [2]}).ok
    assert r.in_flight == 3
    assert not r.reserve("a", reads={Tier.G2: [9]}).ok  # duplicate command id
    r.release("a")
    r.release("a")
    assert r.reserve("e", writes={Tier.G3: [0]}).ok
    for cid in ("b", "e", "f"):
        r.release(cid)
    assert r.in_flight == 0


# --------------------------------------------------------------------------- merging


def test_merge_presence_requires_every_rank() -> None:
    keys = [10, 20, 30, 40]
    per_rank = {
        0: {10: 100, 20: 100, 30: None, 40: 100},
        1: {20: 100, 10: 50, 30: 100},  # any order; 40 missing from the answer
        # rank 2 failed: absent from the mapping
    }
    merged = merge_presence(keys, per_rank, 2)
    assert [m.sequence_hash for m in merged] == keys
    assert [m.present for m in merged] == [True, True, False, False]
    assert merged[0].size_bytes == 150
    assert merged[2].ranks_present == (1,)
    assert merged[3].ranks_present == (0,)
    three = merge_presence(keys, per_rank, 3)
    assert not any(m.present for m in three)
    assert merge_presence([1], {}, 0)[0].present is False


def test_merge_key_results_is_by_key_not_by_position() -> None:
    keys = [1, 2, 3]
    # Rank 0 answers in reverse order, rank 1 in request order; key 1 fails on rank 1 only.
    rank0 = dict(reversed([(1, ("stored", "")), (2, ("stored", "")), (3, ("stored", ""))]))
    rank1 = {1: ("failed", "disk full"), 2: ("already_present", ""), 3: ("stored", "")}
    merged = merge_key_results(keys, {0: rank0, 1: rank1}, {}, 2)
    assert [m.sequence_hash for m in merged] == keys
    assert [m.ok for m in merged] == [False, True, True]
    assert merged[0].errors == {1: "disk full"}
    assert merged[1].rank_status == {0: "stored", 1: "already_present"}
    assert merged[1].already_present is False


def test_merge_key_results_positional_merge_would_be_wrong() -> None:
    """The seed merged by list position; answers in different orders must not mix keys."""
    keys = [7, 8]
    per_rank = {0: {8: ("not_found", "nope"), 7: ("retrieved", "")}, 1: {7: ("retrieved", "")}}
    merged = merge_key_results(keys, per_rank, {}, 2)
    assert merged[0].ok is True
    assert merged[1].ok is False
    assert merged[1].rank_status == {0: "not_found", 1: "missing"}
    assert "rank 1 returned no result" in merged[1].errors[1]


def test_merge_key_results_rank_failure_fails_every_key() -> None:
    keys = [1, 2]
    per_rank = {0: {1: ("already_present", ""), 2: ("already_present", "")}}
    merged = merge_key_results(keys, per_rank, {1: "UNAVAILABLE: rank 1 gone"}, 2)
    assert [m.ok for m in merged] == [False, False]
    assert all(m.errors == {1: "UNAVAILABLE: rank 1 gone"} for m in merged)
    ok = merge_key_results(keys, per_rank, {}, 1)
    assert all(m.ok and m.already_present for m in ok)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_merge_key_results_invariant(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 4))
    keys = data.draw(st.lists(st.integers(0, 1000), unique=True, max_size=8))
    statuses = st.sampled_from(["stored", "already_present", "retrieved", "failed", "not_found"])
    per_rank = {}
    for r in range(n):
        answered = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
        random.Random(r).shuffle(answered)
        per_rank[r] = {k: (data.draw(statuses), "e") for k in answered}
    merged = merge_key_results(keys, per_rank, {}, n)
    for m in merged:
        expect = all(
            m.sequence_hash in per_rank[r]
            and per_rank[r][m.sequence_hash][0] in ("stored", "already_present", "retrieved")
            for r in range(n)
        )
        assert m.ok is expect


# --------------------------------------------------------------------------- errors


def test_rank_failures_names_every_rank_and_keeps_results() -> None:
    failures = {
        3: ParamServerError("rank 3 (x): boom"),
        1: WaitTimeout("rank 1 (y): deadline"),
    }
    err = TransferFailed("op", failures, {0: "r0", 2: "r2"}, 4)
    assert err.failed_ranks == [1, 3]
    assert list(err.results) == [0, 2]
    assert "rank 1" in err.message and "rank 3" in err.message
    assert "ranks that succeeded: 0, 2" in err.message
    assert err.code == grpc.StatusCode.INTERNAL  # mixed codes
    same = RankFailures("op", {1: WaitTimeout("a"), 2: WaitTimeout("b")}, {}, 3)
    assert same.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_verdict_accept_does_not_raise() -> None:
    Verdict.accept().raise_if_refused()
