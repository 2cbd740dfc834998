"""The model shapes of ``benchmarks/push_pull.py --model`` match the documented totals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchlib import models


@pytest.mark.parametrize(
    ("model", "tensors", "params"),
    [("resnet50", 161, 25_557_032), ("resnet18", 62, 11_689_512), ("bert-base", 199, 109_482_240)],
)
def test_shapes_sum_to_documented_totals(model: str, tensors: int, params: int) -> None:
    # Totals as published by torchvision (ResNets) and for bert-base-uncased's BertModel.
    shapes = models.shapes(model)
    assert len(shapes) == tensors
    assert sum(models.numel(s) for s in shapes) == params


def test_resnet50_landmarks() -> None:
    shapes = models.shapes("resnet50")
    assert shapes[0] == (64, 3, 7, 7)  # conv1
    assert shapes[-2:] == [(1000, 2048), (1000,)]  # fc
    # the first downsample: 1x1 conv 64 -> 256, after layer1.0's conv3 and bn3
    assert (256, 64, 1, 1) in shapes[:20]


def test_bert_landmarks() -> None:
    shapes = models.shapes("bert-base")
    assert shapes[0] == (30522, 768)
    assert shapes.count((3072, 768)) == 12 and shapes.count((768, 3072)) == 12


def test_wrong_total_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.EXPECTED, "resnet18", (62, 11_689_513))
    with pytest.raises(AssertionError, match="resnet18"):
        models.shapes("resnet18")
