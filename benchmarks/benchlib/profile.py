"""Summaries of py-spy collapsed-stack profiles of the paramserver server (``--format raw``).

:func:`summarize_collapsed` reports the hottest functions by self and inclusive share, and sorts
every sample into one of the server's cost centres (:data:`CATEGORIES`, first match wins) by the
frames on its stack. With ``py-spy --native`` the C frames (numpy loops, upb protobuf, libc
``memcpy``/``sendmsg``) make the copies visible; without it their time lands on the Python frame
that called them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

Predicate = Callable[[list[str], str], bool]


def _any(*needles: str) -> Predicate:
    return lambda frames, leaf: any(n in f for f in frames for n in needles)


def _all(*preds: Predicate) -> Predicate:
    return lambda frames, leaf: all(p(frames, leaf) for p in preds)


def _leaf(*needles: str) -> Predicate:
    return lambda frames, leaf: any(n in leaf for n in needles)


IDLE = "idle: event loop / gRPC poller waiting (epoll)"
CATEGORIES: tuple[tuple[str, Predicate], ...] = (
    (IDLE, _leaf("epoll_wait", "epoll_pwait")),
    ("apply: update rule math (numpy)", _any("_sgd (", "_adam (", "_adagrad (", "apply_update (")),
    ("apply: non-finite scan of the gradient", _any("count_non_finite (")),
    (
        "pull: snapshot copy of the value",
        _all(_any("Pull ("), _any("PyArray_NewCopy", "array_copy", "PyArray_AssignArray")),
    ),
    (
        "pull: TensorFrame(data=...) copy into protobuf",
        _all(_any("_frames ("), _any("InitAttributes", "PyToUpb")),
    ),
    ("pull: bytes(payload[a:b]) chunk copy", _any("_frames (")),
    ("pull: PullResponse(frame=...) merge (serialize+parse)", _any("MergeFrom", "InitWKTOrMerge")),
    ("pull: message serialization for gRPC", _any("SerializeInternal", "encode_message")),
    ("push: protobuf parse of PushRequest", _any("upb_Decode", "_upb_Decoder")),
    ("push: frame.data + copy into the assembly buffer", _any("TensorAssembler.feed (")),
    ("push: reading the request stream (gRPC message to bytes)", _any("_read_tensors (")),
    ("syscalls: send", _leaf("sendmsg", "writev", "write (")),
    ("syscalls: receive", _leaf("recvmsg", "recv (", "read (")),
    ("allocation: mmap/munmap/brk", _leaf("mmap", "munmap", "brk", "madvise")),
)
OTHER = "other: gRPC core, event loop, interpreter"


def _name(frame: str) -> str:
    """``func (file.py)`` of a py-spy frame ``func (path/file.py:line)``."""
    if " (" not in frame:
        return frame
    func, loc = frame.split(" (", 1)
    return f"{func} ({Path(loc.rstrip(')').split(':')[0]).name})"


def summarize_collapsed(path: Path, top: int = 12) -> dict[str, Any]:
    """Shares of samples (0..1) per function and per cost centre of a collapsed-stack file."""
    self_count: collections.Counter[str] = collections.Counter()
    incl_count: collections.Counter[str] = collections.Counter()
    cats: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        names = [_name(f) for f in frames]
        total += count
        self_count[names[-1]] += count
        for name in set(names):
            incl_count[name] += count
        leaf = frames[-1]
        for cat, pred in CATEGORIES:
            if pred(frames, leaf):
                cats[cat] += count
                break
        else:
            cats[OTHER] += count
    if not total:
        return {"samples": 0}
    busy = total - cats[IDLE]
    return {
        "samples": total,
        "busy_share": round(busy / total, 3),
        "cost_centres_of_busy": [
            (cat, round(n / busy, 3)) for cat, n in cats.most_common() if cat != IDLE and busy
        ],
        "self_top": [(f, round(c / total, 3)) for f, c in self_count.most_common(top)],
        "inclusive_top": [(f, round(c / total, 3)) for f, c in incl_count.most_common(top)],
    }
