"""Merging shards' stores into the logical model and placing it on another shard count (pure),
and finding the newest common cut among shard checkpoint manifests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paramserver.core.optimizers import UpdateRule, apply_update, init_state
from paramserver.core.sharding import layout_key, parse_name
from paramserver.server.config import ServerConfig
from paramserver.server.reshard import (
    LogicalEntry,
    ReshardError,
    _store_of,
    find_cut,
    merge_stores,
    split_model,
)

pytestmark = pytest.mark.timeout(30)


def _model() -> dict[str, LogicalEntry]:
    rng = np.random.default_rng(3)
    out = {}
    for key, shape, dtype, rule in [
        ("w", (50, 40), np.float32, UpdateRule("adam", lr=0.01)),
        ("v", (700,), np.float16, UpdateRule("sgd", lr=0.1, momentum=0.9)),
        ("b", (), np.float64, UpdateRule("sgd", lr=0.1, momentum=0.5)),
        ("n", (300,), np.int64, UpdateRule("add")),
        ("z", (0, 3), np.float32, UpdateRule("adagrad")),
    ]:
        value = rng.normal(size=shape).astype(dtype)
        state = init_state(rule, value)
        for _ in range(3):  # non-trivial optimizer state (adam's step = 3)
            apply_update(rule, value, rng.normal(size=shape).astype(dtype), state)
        out[key] = LogicalEntry(key, value, rule, state, 3)
    return out


def _same(a: LogicalEntry, b: LogicalEntry) -> None:
    assert a.value.dtype == b.value.dtype and a.value.shape == b.value.shape
    assert a.value.tobytes() == b.value.tobytes()
    assert a.rule == b.rule and a.updates == b.updates
    assert sorted(a.state) == sorted(b.state)
    for name in a.state:
        assert a.state[name].shape == b.state[name].shape
        assert a.state[name].tobytes() == b.state[name].tobytes(), name


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("slice_bytes", [64, 1000, 1 << 20])
def test_split_then_merge_is_the_identity(shards: int, slice_bytes: int) -> None:
    model = _model()
    placed = split_model(model, shards, slice_bytes)
    assert len(placed) == shards
    names = [n for part in placed for n in part]
    assert len(names) == len(set(names))
    merged = merge_stores([_store_of(part) for part in placed])
    assert sorted(merged) == sorted(model)
    for key in model:
        _same(merged[key], model[key])


def test_reshard_3_to_2_to_4_with_new_slice_size() -> None:
    model = _model()
    three = [_store_of(p) for p in split_model(model, 3, 256)]
    two = [_store_of(p) for p in split_model(merge_stores(three), 2, 4096)]
    four = merge_stores([_store_of(p) for p in split_model(merge_stores(two), 4, 100)])
    for key in model:
        _same(four[key], model[key])


def test_merge_refuses_missing_slice_and_duplicates() -> None:
    placed = split_model(_model(), 2, 256)
    victim = next(n for part in placed for n in part if parse_name(n)[0] == "slice")
    damaged = [{n: e for n, e in part.items() if n != victim} for part in placed]
    with pytest.raises(ReshardError, match="missing"):
        merge_stores([_store_of(p) for p in damaged])
    with pytest.raises(ReshardError, match="two shards"):
        merge_stores([_store_of(placed[0]), _store_of(placed[0])])
    orphans = [{n: e for n, e in part.items() if n != layout_key("w")} for part in placed]
    with pytest.raises(ReshardError, match="without a layout"):
        merge_stores([_store_of(p) for p in orphans])


def _fake(root: Path, index: int, shards: int, cuts: list[tuple[int, bool]]) -> Path:
    d = root / f"shard-{index}"
    for seq, (step, exact) in enumerate(cuts, start=1):
        ck = d / f"ckpt-{seq:08d}"
        ck.mkdir(parents=True)
        manifest = {
            "shard": {
                "shard_index": index,
                "num_shards": shards,
                "cut_step": step,
                "exact_cut": exact,
                "slice_bytes": 1024,
            }
        }
        (ck / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_find_cut_picks_newest_common_exact_cut(tmp_path: Path) -> None:
    _fake(tmp_path, 0, 3, [(10, True), (20, True), (30, True)])
    _fake(tmp_path, 1, 3, [(10, True), (20, True), (25, False)])
    _fake(tmp_path, 2, 3, [(20, True), (30, True)])
    cut = find_cut([tmp_path])  # the parent of shard-* works too
    assert cut.step == 20 and cut.exact
    assert [p.parent.name for p in cut.paths] == ["shard-0", "shard-1", "shard-2"]


def test_find_cut_errors_name_the_problem(tmp_path: Path) -> None:
    a = _fake(tmp_path / "a", 0, 2, [(10, True)])
    b = _fake(tmp_path / "a", 1, 2, [(20, True)])
    with pytest.raises(ReshardError, match=r"no common cut.*shard 0: \[10\]; shard 1: \[20\]"):
        find_cut([a, b])
    with pytest.raises(ReshardError, match="pass one directory per shard"):
        find_cut([a])
    with pytest.raises(ReshardError, match="given twice"):
        find_cut([a, a])
    c = _fake(tmp_path / "c", 1, 3, [(10, True)])
    with pytest.raises(ReshardError, match="different sizes"):
        find_cut([a, c])


def test_config_reads_shard_fields_from_environment() -> None:
    env = {
        "PARAMSERVER_SHARD_INDEX": "1",
        "PARAMSERVER_SHARD_ADDRESSES": "ps:50051,ps-1:50051",
        "PARAMSERVER_SLICE_BYTES": "1048576",
        "PARAMSERVER_METRICS_PORT": "9100",
    }
    cfg = ServerConfig.from_sources({"shard_index": 0}, env)
    assert (cfg.shard_index, cfg.num_shards, cfg.slice_bytes, cfg.metrics_port) == (
        0,
        2,
        1 << 20,
        9100,
    )
    with pytest.raises(Exception, match="shard_index"):
        ServerConfig(shard_index=2, shard_addresses="a:1,b:2")
    with pytest.raises(Exception, match="restore_from"):
        ServerConfig(restore_from="/x")
