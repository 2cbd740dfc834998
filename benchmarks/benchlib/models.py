"""Parameter-tensor shapes of real architectures, written out (no model download).

Each function lists one shape per *parameter* tensor (``model.parameters()`` order of the
reference implementation; buffers such as BatchNorm running statistics are not parameters and
are not listed), so a benchmark can hold one key per tensor as a training job does:

- ``resnet50`` / ``resnet18``: torchvision's ``resnet50()`` / ``resnet18()`` (He et al., "Deep
  Residual Learning for Image Recognition", CVPR 2016), 1000 classes: conv weights without bias,
  BatchNorm weight and bias, the final ``fc`` weight and bias. torchvision documents
  25,557,032 parameters for ResNet-50 and 11,689,512 for ResNet-18.
- ``bert-base``: Hugging Face ``BertModel`` of ``bert-base-uncased`` (Devlin et al., "BERT",
  NAACL 2019): 30,522-token vocabulary, 512 positions, 2 token types, 12 layers of hidden size
  768, 12 heads, intermediate size 3072, with the pooler: 109,482,240 parameters.

:data:`EXPECTED` holds the documented (tensors, parameters) of each; :func:`shapes` checks the
list against it, so a typo in a shape cannot pass unnoticed.
"""

from __future__ import annotations

import math

Shape = tuple[int, ...]

#: name -> (parameter tensors, parameters), as documented by the reference implementations.
EXPECTED: dict[str, tuple[int, int]] = {
    "resnet50": (161, 25_557_032),
    "resnet18": (62, 11_689_512),
    "bert-base": (199, 109_482_240),
}


def _bn(c: int) -> list[Shape]:
    return [(c,), (c,)]  # weight (gamma), bias (beta)


def _resnet(block: str, layers: tuple[int, int, int, int], classes: int = 1000) -> list[Shape]:
    expansion = 4 if block == "bottleneck" else 1
    out: list[Shape] = [(64, 3, 7, 7), *_bn(64)]  # conv1, bn1
    inplanes = 64
    for stage, blocks in enumerate(layers):
        planes = 64 << stage
        for b in range(blocks):
            if block == "bottleneck":
                out += [(planes, inplanes, 1, 1), *_bn(planes)]
                out += [(planes, planes, 3, 3), *_bn(planes)]
                out += [(planes * 4, planes, 1, 1), *_bn(planes * 4)]
            else:
                out += [(planes, inplanes, 3, 3), *_bn(planes)]
                out += [(planes, planes, 3, 3), *_bn(planes)]
            if b == 0 and (stage > 0 or inplanes != planes * expansion):
                out += [(planes * expansion, inplanes, 1, 1), *_bn(planes * expansion)]
            inplanes = planes * expansion
    out += [(classes, 512 * expansion), (classes,)]  # fc
    return out


def _bert_base() -> list[Shape]:
    hidden, inter, vocab, positions, types, layers = 768, 3072, 30522, 512, 2, 12
    out: list[Shape] = [(vocab, hidden), (positions, hidden), (types, hidden), *_bn(hidden)]
    for _ in range(layers):
        for _qkv_out in range(4):  # query, key, value, attention output dense
            out += [(hidden, hidden), (hidden,)]
        out += _bn(hidden)  # attention output LayerNorm
        out += [(inter, hidden), (inter,), (hidden, inter), (hidden,)]
        out += _bn(hidden)  # output LayerNorm
    out += [(hidden, hidden), (hidden,)]  # pooler dense
    return out


_BUILDERS = {
    "resnet50": lambda: _resnet("bottleneck", (3, 4, 6, 3)),
    "resnet18": lambda: _resnet("basic", (2, 2, 2, 2)),
    "bert-base": _bert_base,
}
MODELS = tuple(_BUILDERS)


def numel(shape: Shape) -> int:
    """Elements of one tensor of ``shape``."""
    return math.prod(shape)


def shapes(model: str) -> list[Shape]:
    """The parameter shapes of ``model``, checked against :data:`EXPECTED`.

    Raises:
        KeyError: unknown model.
        AssertionError: the written-out list does not match the documented totals.
    """
    out = _BUILDERS[model]()
    tensors, params = EXPECTED[model]
    got = sum(numel(s) for s in out)
    assert (len(out), got) == (tensors, params), (
        f"{model}: {len(out)} tensors, {got:,} parameters; expected {tensors}, {params:,}"
    )
    return out
