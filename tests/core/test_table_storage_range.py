"""Half-precision embedding tables refuse a push whose result overflows their dtype, as dense
keys do (issue 30, item 4): the whole push refused when it is decided, nothing changed.

Expected results come from a numpy reference of each rule written here (row by row, float32,
rounded once to the storage dtype), independent of the table code.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from paramserver.core.consistency import ClusterState, Consistency
from paramserver.core.table_set import TableSet
from paramserver.core.tables import EmbeddingTable, Initializer, TableRule, TableSpec
from paramserver.errors import InvalidArgument, ValueOutOfRange

KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
DTYPES = ["float16", "bfloat16"]
DIM = 4
STORED = np.array([3, 5], np.int64)  # rows stored at the dtype's largest value
NEW_ID = 9
#: Learning rates: SMALL moves a row at the dtype's max past it; BIG moves a fresh row past it.
SMALL = {"float16": 64.0, "bfloat16": 2.0e36}
BIG = {"float16": 70000.0, "bfloat16": 3.4e38}


def _np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float16) if dtype == "float16" else np.dtype(ml_dtypes.bfloat16)


def _max(dtype: str) -> float:
    return float(ml_dtypes.finfo(_np_dtype(dtype)).max)


def _cluster() -> tuple[ClusterState, str]:
    c = ClusterState(consistency=Consistency.ASP, lease_s=100.0)
    return c, c.register("w", 0.0)[0].worker_id


def _spec(kind: str, dtype: str, lr: float, consistency: str = "asp") -> TableSpec:
    return TableSpec(
        "emb",
        DIM,
        dtype,
        TableRule(kind, lr=lr),
        Initializer("normal", 0.1),
        7,
        consistency=consistency,
    )


def _at_max(ts: TableSet, c: ClusterState, wid: str, spec: TableSpec) -> None:
    """Declare ``spec`` and store STORED at the dtype's largest value: one push of zero
    gradients (creates the rows and their state), then the rows set by a state reload."""
    ts.init(spec)
    table = ts.get(spec.name)
    zeros = np.zeros((STORED.shape[0], DIM), np.float32)
    ts.commit(ts.prepare(c, wid, 1, 0, spec.name, STORED, zeros), now_s=0.0)
    arrays = table.state_arrays()
    arrays["rows"][:] = _max(spec.dtype)
    table.load_state_arrays(arrays)


def _reference(
    spec: TableSpec, before: dict[str, np.ndarray], ids: np.ndarray, grads: np.ndarray
) -> dict[int, np.ndarray]:
    """Each pushed id's stored row after the push (numpy, float32, rounded once), from the
    state before it (``state_arrays``); a new id starts from its pulled initial row."""
    r, f = spec.rule, np.float32
    out = {}
    for i in np.unique(ids).tolist():
        g = grads[ids == i].astype(np.float32).sum(axis=0, dtype=np.float32)
        at = np.flatnonzero(before["ids"] == i)
        if at.shape[0]:
            k = int(at[0])
            w = before["rows"][k].astype(np.float32)
            acc = before["acc"][k].copy() if "acc" in before else None
            m = before["m"][k].copy() if "m" in before else None
            v = before["v"][k].copy() if "v" in before else None
            t = int(before["steps"][k]) if "steps" in before else 0
        else:
            w = EmbeddingTable(spec).pull(np.array([i], np.int64))[0].astype(np.float32)
            acc = np.full(DIM if r.kind == "adagrad" else (), f(r.initial_accumulator))
            m, v, t = np.zeros(DIM, f), np.zeros(DIM, f), 0
        with np.errstate(over="ignore", invalid="ignore"):
            if r.kind == "sgd":
                w = w - f(r.lr) * g
            elif r.kind == "adagrad":
                acc = acc + g * g
                w = w - f(r.lr) * g / (np.sqrt(acc) + f(r.eps))
            elif r.kind == "rowwise_adagrad":
                acc = acc + f(np.mean(g * g, dtype=np.float32))
                w = w - f(r.lr) * g / (np.sqrt(acc) + f(r.eps))
            else:
                t += 1
                m = f(r.beta1) * m + f(1 - r.beta1) * g
                v = f(r.beta2) * v + f(1 - r.beta2) * g * g
                ss = r.lr * math.sqrt(1 - r.beta2**t) / (1 - r.beta1**t)
                w = w - f(ss) * m / (np.sqrt(v) + f(r.eps))
            out[i] = w.astype(spec.np_dtype)
    return out


def _cases(kind: str, dtype: str, touch: str) -> tuple[TableSpec, np.ndarray, np.ndarray, int, int]:
    """(spec, ids, grads, bad id, bad column) of a push that overflows one element.

    existing: id 5 (at max) gets -1 in column 2 (two rows of -0.5: duplicates are summed
    first), moving it up by about lr = SMALL; id 3 (at max) gets +1 everywhere, moving down.
    new: id 9 (no row) gets -1 in column 1 with lr = BIG; id 3 moves down, in range.
    """
    if touch == "existing":
        spec = _spec(kind, dtype, SMALL[dtype])
        ids = np.array([5, 3, 5], np.int64)
        grads = np.zeros((3, DIM), np.float32)
        grads[0, 2] = grads[2, 2] = -0.5
        grads[1] = 1.0
        return spec, ids, grads, 5, 2
    spec = _spec(kind, dtype, BIG[dtype])
    ids = np.array([3, NEW_ID], np.int64)
    grads = np.zeros((2, DIM), np.float32)
    grads[0] = 1.0
    grads[1, 1] = -1.0
    return spec, ids, grads, NEW_ID, 1


@pytest.mark.parametrize("touch", ["existing", "new"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_overflowing_row_push_is_refused_when_decided_and_changes_nothing(
    kind: str, dtype: str, touch: str
) -> None:
    spec, ids, grads, bad_id, bad_col = _cases(kind, dtype, touch)
    c, wid = _cluster()
    ts = TableSet()
    _at_max(ts, c, wid, spec)
    table = ts.get("emb")
    before = table.state_arrays()
    want = _reference(spec, before, ids, grads)
    # The reference agrees the push overflows exactly there (and nowhere else).
    for i, row in want.items():
        finite = np.isfinite(row.astype(np.float32))
        assert finite.all() == (i != bad_id), (i, row)
    assert not np.isfinite(want[bad_id][bad_col].astype(np.float32))
    counters = {k: getattr(table, k) for k in ("pushes", "rows_pushed", "filtered", "n")}
    stats = (ts.stats["emb"].applied_pushes, ts.stats["emb"].newest_clock)

    with pytest.raises(ValueOutOfRange) as info:
        ts.prepare(c, wid, 2, 0, "emb", ids, grads)
    assert isinstance(info.value, InvalidArgument)  # INVALID_ARGUMENT, as for dense keys
    limit = _max(dtype)
    message = info.value.message
    assert "table 'emb'" in message and f"rule {kind!r}" in message
    assert f"id {bad_id} column {bad_col}" in message
    assert f"{dtype} [-{limit:g}, {limit:g}]" in message and "nothing applied" in message

    after = table.state_arrays()  # rows, optimizer state, filter counts: bit for bit
    assert sorted(after) == sorted(before)
    for name in before:
        assert after[name].tobytes() == before[name].tobytes(), name
    assert {k: getattr(table, k) for k in counters} == counters
    assert (ts.stats["emb"].applied_pushes, ts.stats["emb"].newest_clock) == stats

    # The same request id is not remembered: the push without the offending row applies.
    keep = ids != bad_id
    ok_ids, ok_grads = ids[keep], grads[keep]
    out = ts.commit(ts.prepare(c, wid, 2, 0, "emb", ok_ids, ok_grads), now_s=0.0)
    assert not out.duplicate and out.result.applied == np.unique(ok_ids).shape[0]
    ok_want = _reference(spec, before, ok_ids, ok_grads)
    got = table.pull(np.array(sorted(ok_want), np.int64))
    np.testing.assert_allclose(
        got.astype(np.float32),
        np.stack([ok_want[i] for i in sorted(ok_want)]).astype(np.float32),
        rtol=1e-2,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_issue_example_and_a_result_that_rounds_to_the_max_is_kept(dtype: str) -> None:
    """65504 minus a gradient of -32 (sgd, lr 1) is 65536: refused. A result that rounds back
    to the largest value (65504 + 8 -> 65504) is stored."""
    top = _max(dtype)
    step = {"float16": (32.0, 8.0), "bfloat16": (2.0e36, 1.0e35)}[dtype]
    c, wid = _cluster()
    ts = TableSet()
    _at_max(ts, c, wid, _spec("sgd", dtype, 1.0))
    g = np.zeros((1, DIM), np.float32)
    g[0, 0] = -step[0]
    with pytest.raises(ValueOutOfRange, match=r"id 5 column 0"):
        ts.prepare(c, wid, 2, 0, "emb", np.array([5], np.int64), g)
    g[0, 0] = -step[1]
    ts.commit(ts.prepare(c, wid, 3, 0, "emb", np.array([5], np.int64), g), now_s=0.0)
    want = np.full(DIM, top, np.float32).astype(_np_dtype(dtype))
    assert ts.get("emb").pull(np.array([5], np.int64))[0].tobytes() == want.tobytes()


def test_a_filtered_new_id_is_not_checked_and_an_existing_inf_is_not_blamed() -> None:
    """min_pushes 2: the first push of a new id is dropped by the filter (so its huge update
    would not be applied: not refused); its second push would store it: refused. A row already
    holding Inf is not blamed for staying Inf."""
    spec = TableSpec(
        "emb", DIM, "float16", TableRule("sgd", lr=1.0), Initializer("zeros"), 7, min_pushes=2
    )
    c, wid = _cluster()
    ts = TableSet()
    ts.init(spec)
    huge = np.full((1, DIM), -70000.0, np.float32)
    out = ts.commit(ts.prepare(c, wid, 1, 0, "emb", np.array([4], np.int64), huge), now_s=0.0)
    assert out.result.filtered == 1
    with pytest.raises(ValueOutOfRange, match="id 4 column 0"):
        ts.prepare(c, wid, 2, 0, "emb", np.array([4], np.int64), huge)
    table = ts.get("emb")
    arrays = table.state_arrays()
    assert arrays["pending_ids"].tolist() == [4] and arrays["pending_counts"].tolist() == [1]
    # A stored row holding Inf (from before this check existed, say) keeps it; no refusal.
    one = np.ones((1, DIM), np.float32)
    ts.commit(ts.prepare(c, wid, 3, 0, "emb", np.array([6], np.int64), one), now_s=0.0)
    ts.commit(ts.prepare(c, wid, 4, 0, "emb", np.array([6], np.int64), one), now_s=0.0)
    arrays = table.state_arrays()
    arrays["rows"][arrays["ids"] == 6, 0] = np.inf
    table.load_state_arrays(arrays)
    ts.commit(ts.prepare(c, wid, 5, 0, "emb", np.array([6], np.int64), one), now_s=0.0)
    got = table.pull(np.array([6], np.int64))[0].astype(np.float32)
    np.testing.assert_array_equal(got, [np.inf, -2, -2, -2])


def test_float32_tables_are_not_range_checked() -> None:
    """As float32 dense keys: same-dtype arithmetic, nothing to round into a narrower type."""
    c, wid = _cluster()
    ts = TableSet()
    ts.init(_spec("sgd", "float32", 1.0))
    g = np.full((1, DIM), -1.0e5, np.float32)
    prepared = ts.prepare(c, wid, 1, 0, "emb", np.array([1], np.int64), g)
    assert prepared.coalesced is None
    ts.commit(prepared, now_s=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bsp_step_whose_mean_overflows_is_not_applied_to_that_table(dtype: str) -> None:
    """bsp pushes are acknowledged when queued; a step whose mean would overflow leaves the
    table's rows and state as they were (counted), as a dense bsp key keeps its value for
    the step; the next step applies."""
    top = _max(dtype)
    lr = SMALL[dtype]
    c = ClusterState(consistency=Consistency.BSP, lease_s=100.0)
    a, b = (c.register(n, 0.0)[0].worker_id for n in ("a", "b"))
    ts = TableSet()
    _at_max(ts, c, a, _spec("sgd", dtype, lr, consistency="bsp"))
    c.clock(a, 0)
    c.clock(b, 0)
    ts.close_steps(c.min_clock(), 2)  # step 0: the zero push
    table = ts.get("emb")
    arrays = table.state_arrays()
    arrays["rows"][:] = top
    table.load_state_arrays(arrays)
    before = table.state_arrays()
    up = np.zeros((1, DIM), np.float32)
    up[0, 3] = -1.0  # mean over 2 workers: -1, sgd: +lr beyond the max
    down = np.ones((1, DIM), np.float32)
    for wid in (a, b):
        ts.commit(ts.prepare(c, wid, 10, 1, "emb", np.array([5], np.int64), up), now_s=0.0)
        ts.commit(ts.prepare(c, wid, 11, 1, "emb", np.array([3], np.int64), down), now_s=0.0)
        c.clock(wid, 1)
    assert ts.close_steps(c.min_clock(), 2) == 1
    after = table.state_arrays()
    for name in before:
        assert after[name].tobytes() == before[name].tobytes(), name
    assert ts.stats["emb"].out_of_range_steps == 1
    for wid in (a, b):
        ts.commit(ts.prepare(c, wid, 12, 2, "emb", np.array([3], np.int64), down), now_s=0.0)
        c.clock(wid, 2)
    ts.close_steps(c.min_clock(), 2)
    want = (np.float32(top) - np.float32(lr)).astype(_np_dtype(dtype))
    got = table.pull(np.array([3], np.int64))[0]
    assert got.tobytes() == np.full(DIM, want).tobytes()
