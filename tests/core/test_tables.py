"""Embedding tables, pure core: rules vs numpy oracles and torch, lazy init, filter, expiry,
validation (docs/embedding-tables.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from paramserver.core import row_store
from paramserver.core.tables import (
    EmbeddingTable,
    IdIndex,
    Initializer,
    TableLimits,
    TableRule,
    TableSpec,
    coalesce,
    initial_rows,
    shard_of_ids,
)
from paramserver.errors import DTypeMismatch, InvalidArgument, WrongShard
from paramserver.protocol.table_spec import check_owned

try:
    import torch
except ImportError:  # the torch comparisons skip; the numpy oracles still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _table(rule: TableRule, dim: int = 4, dtype: str = "float32", **kw: object) -> EmbeddingTable:
    return EmbeddingTable(TableSpec("emb", dim, dtype, rule, Initializer("normal", 0.1), 7, **kw))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- initial rows
def test_initial_rows_pure_function_of_seed_and_id() -> None:
    init = Initializer("uniform", 0.5)
    ids = np.array([5, 1, 99, 1 << 40, 5], np.int64)
    full = initial_rows(3, ids, 8, init)
    # any subset, any order, gives the same rows; a different seed differs
    np.testing.assert_array_equal(initial_rows(3, ids[::-1], 8, init), full[::-1])
    np.testing.assert_array_equal(initial_rows(3, ids[2:3], 8, init), full[2:3])
    np.testing.assert_array_equal(full[0], full[4])
    assert not np.array_equal(initial_rows(4, ids, 8, init), full)
    assert full.dtype == np.float32 and np.all(np.abs(full) <= 0.5)


def test_initial_rows_distributions() -> None:
    ids = np.arange(20000, dtype=np.int64)
    u = initial_rows(1, ids, 16, Initializer("uniform", 1.0)).ravel()
    assert abs(u.mean()) < 0.01 and abs(u.var() - 1.0 / 3.0) < 0.01
    n = initial_rows(1, ids, 16, Initializer("normal", 2.0)).ravel()
    assert abs(n.mean()) < 0.03 and abs(n.std() - 2.0) < 0.02
    assert not initial_rows(1, ids[:4], 3, Initializer("zeros")).any()


# ---------------------------------------------------------------------------- index
def test_id_index_matches_a_dict() -> None:
    rng = np.random.default_rng(0)
    index = IdIndex(capacity=16)
    oracle: dict[int, int] = {}
    for _ in range(30):
        cand = np.unique(rng.integers(0, 1 << 62, 200).astype(np.int64))
        cand = np.concatenate([cand, rng.integers(0, 50, 20)]).astype(np.int64)
        cand = np.unique(cand)
        fresh = cand[index.lookup(cand) < 0]
        vals = np.arange(len(oracle), len(oracle) + fresh.shape[0], dtype=np.int64)
        index.insert(fresh, vals)
        oracle.update(zip(fresh.tolist(), vals.tolist(), strict=True))
    probe = np.concatenate([np.array(list(oracle), np.int64), rng.integers(0, 1 << 62, 500)])
    want = np.array([oracle.get(int(i), -1) for i in probe], np.int64)
    np.testing.assert_array_equal(index.lookup(probe), want)
    assert index.size == len(oracle)


def test_shard_of_ids_is_a_stable_partition() -> None:
    ids = np.arange(10000, dtype=np.int64)
    s = shard_of_ids("emb", ids, 3)
    assert set(np.unique(s).tolist()) == {0, 1, 2}
    assert np.all(np.bincount(s) > 3000)
    np.testing.assert_array_equal(shard_of_ids("emb", ids[::-1], 3), s[::-1])
    assert not np.array_equal(shard_of_ids("other", ids, 3), s)


# ---------------------------------------------------------------------------- pull / push
def test_pull_keeps_order_and_duplicates() -> None:
    t = _table(TableRule("sgd", lr=1.0))
    ids = np.array([3, 1, 3, 8], np.int64)
    init = initial_rows(7, ids, 4, Initializer("normal", 0.1))
    np.testing.assert_array_equal(t.pull(ids), init)
    assert t.n == 0  # a pull stores nothing


def test_coalesce_sums_duplicates() -> None:
    ids = np.array([4, 2, 4, 4, 9], np.int64)
    g = np.arange(10, dtype=np.float32).reshape(5, 2)
    u, s = coalesce(ids, g)
    np.testing.assert_array_equal(u, [2, 4, 9])
    np.testing.assert_array_equal(s, [[2, 3], [0 + 4 + 6, 1 + 5 + 7], [8, 9]])


def _oracle_step(
    kind: str, w: np.ndarray, g: np.ndarray, st: dict[str, np.ndarray], r: TableRule
) -> None:
    """Independent per-row float64-free reference of one rule step (row by row, float32)."""
    f = np.float32
    if kind == "sgd":
        w -= f(r.lr) * g
    elif kind == "adagrad":
        st["acc"] += g * g
        w -= f(r.lr) * g / (np.sqrt(st["acc"]) + f(r.eps))
    elif kind == "rowwise_adagrad":
        st["acc"] += f(np.mean(g * g, dtype=np.float32))
        w -= f(r.lr) * g / (np.sqrt(st["acc"]) + f(r.eps))
    else:
        st["t"] += 1
        t = int(st["t"][0])
        st["m"] = f(r.beta1) * st["m"] + f(1 - r.beta1) * g
        st["v"] = f(r.beta2) * st["v"] + f(1 - r.beta2) * g * g
        ss = r.lr * math.sqrt(1 - r.beta2**t) / (1 - r.beta1**t)
        w -= f(ss) * st["m"] / (np.sqrt(st["v"]) + f(r.eps))


@pytest.fixture(params=[1, 3], ids=["one-part", "three-parts"])
def row_parts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Row calls in one part, or split in three parts of every call, however small, run at
    once on row threads (as a large call is on a machine with several cores)."""
    parts = int(request.param)
    if parts == 1:
        yield 1
        return
    with ThreadPoolExecutor(parts - 1) as pool:
        monkeypatch.setattr(row_store, "_row_threads", lambda: (parts, pool))
        monkeypatch.setattr(row_store, "SPLIT_MIN_ELEMENTS", 1)
        yield parts


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_rules_against_a_per_row_oracle(kind: str, dtype: str, row_parts: int) -> None:
    rule = TableRule(kind, lr=0.05)
    t = _table(rule, dim=3, dtype=dtype)
    rng = np.random.default_rng(1)
    np_dtype = t.spec.np_dtype
    init = Initializer("normal", 0.1)
    rows: dict[int, np.ndarray] = {}
    states: dict[int, dict[str, np.ndarray]] = {}
    touched_before = None
    for step in range(6):
        ids = rng.integers(0, 12, 10).astype(np.int64)
        g = rng.normal(size=(10, 3)).astype(np.float32)
        if step == 5:
            before = t.state_arrays()
            touched_before = set(ids.tolist())
        t.push(t.check_push(ids, g), g, now_s=0.0, clock=step)
        for i in np.unique(ids).tolist():
            gi = g[ids == i].sum(axis=0, dtype=np.float32)
            if i not in rows:
                rows[i] = initial_rows(7, np.array([i]), 3, init)[0].astype(np_dtype)
                states[i] = {
                    "acc": np.zeros(3 if kind == "adagrad" else 1, np.float32),
                    "m": np.zeros(3, np.float32),
                    "v": np.zeros(3, np.float32),
                    "t": np.zeros(1, np.int64),
                }
            w = rows[i].astype(np.float32)
            _oracle_step(kind, w, gi, states[i], rule)
            rows[i] = w.astype(np_dtype)
    all_ids = np.array(sorted(rows), np.int64)
    got = t.pull(all_ids)
    want = np.stack([rows[i] for i in all_ids.tolist()])
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
    # rows the last push did not touch are bit-identical to before it
    after = t.state_arrays()
    assert touched_before is not None
    for j, i in enumerate(before["ids"].tolist()):
        if i not in touched_before:
            k = int(np.flatnonzero(after["ids"] == i)[0])
            assert after["rows"][k].tobytes() == before["rows"][j].tobytes()


def _torch_run(
    opt_name: str, ids_per_step: list[np.ndarray], grads: list[np.ndarray], w0: np.ndarray
) -> np.ndarray:
    emb = torch.nn.Embedding(w0.shape[0], w0.shape[1], sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    if opt_name == "adam":
        opt: torch.optim.Optimizer = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    else:
        opt = torch.optim.Adagrad(emb.parameters(), lr=0.05)
    for ids, g in zip(ids_per_step, grads, strict=True):
        opt.zero_grad()
        out = emb(torch.from_numpy(ids))
        out.backward(torch.from_numpy(g))
        opt.step()
    return emb.weight.detach().numpy().copy()


@needs_torch
@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_rules_against_torch_optimizers(kind: str) -> None:
    """Adagrad vs torch.optim.Adagrad (sparse grads) and lazy adam vs torch.optim.SparseAdam.

    SparseAdam counts steps per parameter, the table per row; they agree when every push
    touches the same rows, as here (duplicates inside each push included).
    """
    rng = np.random.default_rng(2)
    n, dim = 6, 5
    t = _table(TableRule(kind, lr=0.05), dim=dim)
    w0 = initial_rows(7, np.arange(n, dtype=np.int64), dim, Initializer("normal", 0.1))
    steps_ids, steps_g = [], []
    for _ in range(5):
        ids = np.concatenate([np.arange(n), rng.integers(0, n, 4)]).astype(np.int64)
        rng.shuffle(ids)
        g = rng.normal(size=(ids.shape[0], dim)).astype(np.float32)
        steps_ids.append(ids)
        steps_g.append(g)
        t.push(t.check_push(ids, g), g, now_s=0.0, clock=0)
    want = _torch_run(kind, steps_ids, steps_g, w0)
    np.testing.assert_allclose(t.pull(np.arange(n, dtype=np.int64)), want, rtol=2e-5, atol=1e-6)


@needs_torch
def test_adagrad_sparse_touching_subsets_matches_torch() -> None:
    """Adagrad has no step count: any row subsets per push agree with torch exactly."""
    rng = np.random.default_rng(3)
    t = _table(TableRule("adagrad", lr=0.05), dim=3)
    w0 = initial_rows(7, np.arange(10, dtype=np.int64), 3, Initializer("normal", 0.1))
    ids_l, g_l = [], []
    for _ in range(6):
        ids = rng.integers(0, 10, 7).astype(np.int64)
        g = rng.normal(size=(7, 3)).astype(np.float32)
        ids_l.append(ids)
        g_l.append(g)
        t.push(t.check_push(ids, g), g, now_s=0.0, clock=0)
    np.testing.assert_allclose(
        t.pull(np.arange(10, dtype=np.int64)),
        _torch_run("adagrad", ids_l, g_l, w0),
        rtol=2e-5,
        atol=1e-6,
    )


# ---------------------------------------------------------------------------- memory policy
def test_frequency_filter_closed_form() -> None:
    """With min_pushes k and sgd, m pushes of g leave init - lr * g * max(0, m - k + 1)."""
    k, lr = 3, 0.5
    t = _table(TableRule("sgd", lr=lr), dim=2, min_pushes=k)
    ids = np.array([10, 10], np.int64)  # one push counts once, duplicates or not
    g = np.ones((2, 2), np.float32)
    init = initial_rows(7, ids[:1], 2, Initializer("normal", 0.1))[0]
    for m in range(1, 6):
        res = t.push(ids, g, now_s=0.0, clock=m)
        want = init - np.float32(lr) * 2 * max(0, m - k + 1)
        np.testing.assert_allclose(t.pull(ids[:1])[0], want, rtol=1e-6)
        assert res.filtered == (1 if m < k else 0)
        assert t.n == (0 if m < k else 1)
    assert t.filtered == k - 1


def test_expiry_by_clocks_and_seconds_closed_form() -> None:
    t = _table(TableRule("sgd", lr=1.0), dim=2, expiry_clocks=3)
    g = np.ones((1, 2), np.float32)
    t.push(np.array([1], np.int64), g, now_s=0.0, clock=0)
    t.push(np.array([2], np.int64), g, now_s=0.0, clock=2)
    assert t.expire(now_s=0.0, clock=2) == 0
    assert t.expire(now_s=0.0, clock=3) == 1  # id 1: 3 - 0 >= 3
    np.testing.assert_array_equal(
        t.pull(np.array([1], np.int64)),
        initial_rows(7, np.array([1]), 2, Initializer("normal", 0.1)),
    )
    assert t.n == 1 and t.expired == 1
    assert t.expire(now_s=0.0, clock=5) == 1 and t.n == 0
    ts = _table(TableRule("sgd", lr=1.0), dim=2, expiry_s=10.0)
    ts.push(np.array([1, 2], np.int64), np.ones((2, 2), np.float32), now_s=100.0, clock=0)
    ts.push(np.array([2], np.int64), g, now_s=105.0, clock=0)
    assert ts.expire(now_s=109.9, clock=0) == 0
    assert ts.expire(now_s=110.0, clock=0) == 1
    np.testing.assert_allclose(
        ts.pull(np.array([2], np.int64))[0],
        initial_rows(7, np.array([2]), 2, Initializer("normal", 0.1))[0] - 2.0,
        rtol=1e-6,
    )


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("ids", "grads", "needle"),
    [
        (np.array([1, -2]), np.zeros((2, 4), np.float32), "negative id -2"),
        (np.array([1, 100]), np.zeros((2, 4), np.float32), "out of range [0, 100)"),
        (np.array([1, 2]), np.zeros((2, 3), np.float32), "shape (2, 4)"),
        (np.array([1, 2]), np.zeros((2, 4), np.float64), "gradient rows are float64"),
        (np.array([1, 2]), np.array([[0, 0, 0, np.nan]] * 2, np.float32), "NaN/Inf"),
        (np.array([1, 2]), np.array([[0, np.inf, 0, 0]] * 2, np.float32), "NaN/Inf"),
        (np.arange(9), np.zeros((9, 4), np.float32), "limit of 8"),
        (np.array([1.0, 2.0]), np.zeros((2, 4), np.float32), "integer"),
    ],
)
def test_bad_input_names_the_table_and_changes_nothing(
    ids: np.ndarray, grads: np.ndarray, needle: str
) -> None:
    t = EmbeddingTable(
        TableSpec("clicks", 4, num_embeddings=100), TableLimits(max_ids=8, max_bytes=1 << 20)
    )
    t.push(np.array([1, 2], np.int64), np.ones((2, 4), np.float32), now_s=0.0, clock=0)
    before = t.state_arrays()
    with pytest.raises(InvalidArgument) as err:
        t.check_push(ids, grads)
    assert "table 'clicks'" in str(err.value) and needle in str(err.value)
    after = t.state_arrays()
    for k, v in before.items():
        assert after[k].tobytes() == v.tobytes()


@pytest.mark.parametrize(
    ("dtype", "grads", "taken"),
    [
        ("float32", np.float64, "takes float32"),
        ("float32", np.float16, "takes float32"),
        ("float16", np.float64, "takes float32 or float16"),
        ("bfloat16", np.int32, "takes float32 or bfloat16"),
    ],
)
def test_a_wrong_dtype_gradient_is_dtype_mismatch_naming_the_table_and_both_dtypes(
    dtype: str, grads: Any, taken: str
) -> None:
    t = EmbeddingTable(TableSpec("clicks", 4, dtype))
    with pytest.raises(DTypeMismatch) as err:
        t.check_push(np.array([1, 2]), np.zeros((2, 4), grads))
    text = str(err.value)
    assert "table 'clicks'" in text and np.dtype(grads).name in text and taken in text, text
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_eps_unset_takes_the_kind_default_and_an_explicit_zero_is_refused() -> None:
    assert TableRule("adagrad").eps == 1e-10 and TableRule("rowwise_adagrad").eps == 1e-10
    assert TableRule("adam").eps == 1e-8 and TableRule("adam", eps=1e-3).eps == 1e-3
    assert TableRule("adagrad") == TableRule("adagrad", eps=1e-10)  # same declaration
    for kind in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
        with pytest.raises(InvalidArgument, match="eps must be finite and > 0, got 0"):
            TableRule(kind, eps=0.0)
    with pytest.raises(InvalidArgument, match="eps"):
        TableRule("adam", eps=-1e-8)


def test_a_bsp_table_declared_with_staleness_is_refused() -> None:
    assert TableSpec("t", 2, consistency="bsp").staleness == 0
    with pytest.raises(InvalidArgument, match=r"table 't'.*bsp.*staleness 0, got 2"):
        TableSpec("t", 2, consistency="bsp", staleness=2)
    assert TableSpec("t", 2, consistency="ssp", staleness=2).staleness == 2


def test_check_owned_refuses_ids_of_other_shards_naming_index_count_and_id() -> None:
    ids = np.arange(200, dtype=np.int64)
    owner = shard_of_ids("emb", ids, 3)
    for shard in range(3):
        check_owned("emb", ids[owner == shard], shard, 3)  # its own: accepted
        foreign = ids[owner != shard]
        mixed = np.concatenate([ids[owner == shard][:5], foreign[:1]])
        with pytest.raises(WrongShard) as err:
            check_owned("emb", mixed, shard, 3)
        text = str(err.value)
        assert f"id {int(foreign[0])} " in text and f"index {shard} of 3" in text, text
        assert "table 'emb'" in text and err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    check_owned("emb", ids, 0, 1)  # a single shard owns every id
    check_owned("emb", np.zeros(0, np.int64), 2, 3)


def test_byte_limit() -> None:
    t = EmbeddingTable(TableSpec("big", 64), TableLimits(max_ids=1 << 20, max_bytes=1000))
    with pytest.raises(InvalidArgument, match=r"table 'big'.*bytes"):
        t.check_ids(np.arange(4))


def test_bad_spec() -> None:
    with pytest.raises(InvalidArgument, match="dtype"):
        TableSpec("x", 4, "float64")
    with pytest.raises(InvalidArgument, match="table rule"):
        TableRule("momentum")
    with pytest.raises(InvalidArgument, match="min_pushes"):
        TableSpec("x", 4, min_pushes=0)


# ---------------------------------------------------------------------------- state, shards
def test_state_round_trip_is_bit_exact() -> None:
    t = _table(TableRule("adam", lr=0.1), dim=3, dtype="bfloat16", min_pushes=2)
    rng = np.random.default_rng(4)
    for c in range(4):
        ids = rng.integers(0, 30, 20).astype(np.int64)
        t.push(ids, rng.normal(size=(20, 3)).astype(np.float32), now_s=float(c), clock=c)
    st = t.state_arrays()
    assert st["rows"].dtype == np.dtype(ml_dtypes.bfloat16) and st["m"].dtype == np.float32
    u = _table(TableRule("adam", lr=0.1), dim=3, dtype="bfloat16", min_pushes=2)
    u.load_state_arrays(st)
    for k, v in u.state_arrays().items():
        assert v.tobytes() == st[k].tobytes(), k
    probe = np.arange(40, dtype=np.int64)
    assert u.pull(probe).tobytes() == t.pull(probe).tobytes()
    g = np.ones((40, 3), np.float32)
    t.push(probe, g, now_s=9.0, clock=9)
    u.push(probe, g, now_s=9.0, clock=9)
    assert u.pull(probe).tobytes() == t.pull(probe).tobytes()


def test_one_vs_three_shards_identical_rows() -> None:
    rule = TableRule("adam", lr=0.05)
    one = _table(rule)
    three = [_table(rule) for _ in range(3)]
    rng = np.random.default_rng(5)
    for c in range(5):
        ids = rng.zipf(1.3, 64).astype(np.int64) % 1000
        g = rng.normal(size=(64, 4)).astype(np.float32)
        one.push(ids, g, now_s=0.0, clock=c)
        shard = shard_of_ids("emb", ids, 3)
        for s in range(3):
            sel = shard == s
            three[s].push(ids[sel], g[sel], now_s=0.0, clock=c)
    probe = np.arange(1000, dtype=np.int64)
    shard = shard_of_ids("emb", probe, 3)
    got = np.empty((1000, 4), np.float32)
    for s in range(3):
        got[shard == s] = three[s].pull(probe[shard == s])
    assert got.tobytes() == one.pull(probe).tobytes()


@pytest.mark.parametrize("seed", range(4))
def test_coalesce_matches_add_at_on_skewed_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.1, 3000) % 500).astype(np.int64)
    g = rng.normal(size=(3000, 5)).astype(np.float32)
    u, s = coalesce(ids, g)
    want = np.zeros((500, 5), np.float64)
    np.add.at(want, ids, g.astype(np.float64))
    np.testing.assert_array_equal(u, np.unique(ids))
    np.testing.assert_allclose(s, want[u], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- compiled row path
def _reference_initial_rows(seed: int, ids: np.ndarray, dim: int, init: Initializer) -> np.ndarray:
    """The initial-row function as whole-array numpy (the contract's steps, written apart from
    the compiled kernels)."""
    u64 = np.uint64
    golden, m1, m2 = u64(0x9E3779B97F4A7C15), u64(0xBF58476D1CE4E5B9), u64(0x94D049BB133111EB)

    def mix(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = x + golden
            z = (z ^ (z >> u64(30))) * m1
            z = (z ^ (z >> u64(27))) * m2
            return z ^ (z >> u64(31))

    seed_key = mix(np.array([seed % (1 << 64)], u64))[0]
    key = mix(ids.astype(np.int64).view(u64) ^ seed_key)
    words = dim if init.kind == "uniform" else 2 * dim
    with np.errstate(over="ignore"):
        counters = (np.arange(1, words + 1, dtype=u64) * golden)[None, :]
        u = (mix(key[:, None] + counters) >> u64(11)).astype(np.float64) / 9007199254740992.0
    if init.kind == "uniform":
        return ((2.0 * u - 1.0) * init.scale).astype(np.float32)
    radius = np.sqrt(-2.0 * np.log1p(-u[:, 0::2]))
    return (radius * np.cos(2.0 * np.pi * u[:, 1::2]) * init.scale).astype(np.float32)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
@pytest.mark.parametrize("seed", [0, 7, -3, 2**64 + 5])
def test_compiled_initial_rows_are_bit_identical_to_the_numpy_steps(kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed % 1000)
    ids = np.concatenate([rng.integers(0, 2**63 - 1, 500), np.arange(20)]).astype(np.int64)
    init = Initializer(kind, 0.37)
    for dim in (1, 3, 64):
        want = _reference_initial_rows(seed, ids, dim, init)
        assert initial_rows(seed, ids, dim, init).tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("init", ["uniform", "normal", "zeros"])
def test_pull_and_new_rows_use_the_initial_rows_bit_for_bit(
    dtype: str, init: str, row_parts: int
) -> None:
    initializer = Initializer(init, 0.5)
    t = EmbeddingTable(TableSpec("emb", 5, dtype, TableRule("sgd", lr=1.0), initializer, 11))  # type: ignore[arg-type]
    ids = np.array([3, 9, 3, 2**40], np.int64)
    want = _reference_initial_rows(11, ids, 5, initializer) if init != "zeros" else np.zeros((4, 5))
    np_dtype = t.spec.np_dtype
    assert t.pull(ids).tobytes() == want.astype(np.float32).astype(np_dtype).tobytes()
    t.push(ids[:1], np.zeros((1, 5), np.float32), now_s=0.0, clock=0)  # stores id 3's row
    assert t.n == 1
    assert t.pull(ids).tobytes() == want.astype(np.float32).astype(np_dtype).tobytes()


def test_a_split_call_covers_every_row_once_and_waits_for_every_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """split_rows: contiguous parts in row order that cover [0, n) exactly once; small work
    stays in one part; an error of one part is raised only after every part finished."""
    import threading
    import time

    with ThreadPoolExecutor(3) as pool:
        monkeypatch.setattr(row_store, "_row_threads", lambda: (4, pool))
        seen = np.zeros(1003, np.int64)
        parts = row_store.split_rows(
            1003, 1 << 18, lambda a, b: seen.__setitem__(slice(a, b), seen[a:b] + 1)
        )
        assert [a for a, _ in parts] == [0, 250, 501, 752] and seen.tolist() == [1] * 1003
        assert row_store.split_rows(1003, 4, lambda a, b: (a, b)) == [(0, (0, 1003))]
        finished = []

        def part(a: int, b: int) -> None:
            if a == 0:
                raise ValueError("first part")
            time.sleep(0.05)
            finished.append((a, threading.current_thread().name))

        with pytest.raises(ValueError, match="first part"):
            row_store.split_rows(1003, 1 << 18, part)
        assert sorted(a for a, _ in finished) == [250, 501, 752]


def test_growth_across_chunks_keeps_every_row_and_never_moves_a_chunk() -> None:
    """Rows land in fixed chunks: growing the table adds chunks and leaves earlier ones where
    they are (no copy of the table), and every row keeps its value (sgd closed form)."""
    dim = 1024  # 4 KiB rows: 2,048 rows a chunk
    t = EmbeddingTable(
        TableSpec("emb", dim, "float32", TableRule("sgd", lr=0.5), Initializer("zeros"), 1)
    )
    t.push(np.array([5], np.int64), np.ones((1, dim), np.float32), now_s=0.0, clock=0)
    first = t._store["rows"].chunks[0]
    counts = np.zeros(7000, np.int64)
    rng = np.random.default_rng(8)
    for _ in range(6):
        ids = rng.integers(0, 7000, 1500).astype(np.int64)
        t.push(ids, np.ones((1500, dim), np.float32), now_s=0.0, clock=0)
        np.add.at(counts, ids, 1)
    counts[5] += 1
    assert len(t._store["rows"].chunks) > 1 and t._store["rows"].chunks[0] is first
    touched = np.flatnonzero(counts)
    assert t.n == touched.shape[0]
    got = t.pull(np.arange(7000, dtype=np.int64))
    np.testing.assert_array_equal(got, np.repeat(-0.5 * counts[:, None], dim, 1).astype(np.float32))


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_compiled_rules_match_the_numpy_rule_step(kind: str) -> None:
    """The float32 kernels and the numpy step (half-precision tables, range checks) agree."""
    rule = TableRule(kind, lr=0.05, initial_accumulator=0.1)
    t = _table(rule, dim=6)
    rng = np.random.default_rng(5)
    ids = np.arange(40, dtype=np.int64)
    w = initial_rows(7, ids, 6, Initializer("normal", 0.1))
    state = {
        "acc": np.full((40, 6) if kind == "adagrad" else (40,), 0.1, np.float32),
        "m": np.zeros((40, 6), np.float32),
        "v": np.zeros((40, 6), np.float32),
        "steps": np.zeros(40, np.int64),
    }
    for _ in range(4):
        g = rng.normal(size=(40, 6)).astype(np.float32)
        t.push(ids, g, now_s=0.0, clock=0)
        t._rule_step(w, g, {k: v for k, v in state.items() if k in t._state_names()})
    np.testing.assert_allclose(t.pull(ids), w, rtol=2e-6, atol=1e-7)


def test_rows_of_a_table_without_expiry_carry_no_bookkeeping() -> None:
    plain = _table(TableRule("sgd"), dim=16)
    timed = _table(TableRule("sgd"), dim=16, expiry_clocks=3)
    # every table keeps a version (int64) a row; one with expiry its last clock and time
    assert plain.row_bytes == 16 * 4 + 8 and timed.row_bytes == 16 * 4 + 8 + 8 + 8
    adam = _table(TableRule("adam"), dim=16)
    adam.push(np.arange(10, dtype=np.int64), np.ones((10, 16), np.float32), now_s=0, clock=0)
    assert adam.state_bytes() == 10 * (16 * 4 * 2 + 8)
    assert adam.stored_bytes() == 10 * adam.row_bytes + adam.index.nbytes


def test_every_table_rule_has_exactly_one_registry_entry_and_wire_value() -> None:
    """One entry per table rule: the declared kinds, the registry's applies and the wire's
    TableRuleKind values (UNSPECIFIED reads as sgd) are the same set, so a kind that passes
    validation always reaches its own apply (no silent default)."""
    from paramserver.api.v1 import tables_pb2 as tpb
    from paramserver.core.tables import ROW_RULES, TABLE_RULE_KINDS
    from paramserver.protocol import rows_wire

    assert tuple(ROW_RULES) == TABLE_RULE_KINDS
    wire = {
        v.name.removeprefix("TABLE_RULE_KIND_").lower() for v in tpb.TableRuleKind.DESCRIPTOR.values
    }
    assert wire - {"unspecified"} == set(ROW_RULES)
    for kind in ROW_RULES:
        spec = TableSpec("t", 3, rule=TableRule(kind))
        assert rows_wire.spec_from_proto(rows_wire.spec_to_proto(spec)).rule.kind == kind
