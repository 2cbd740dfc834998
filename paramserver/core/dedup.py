"""Request ids remembered per registration, for every mutation kind that carries one.

A worker numbers its requests; a retried request (same registration, same kind, same request
id) is answered with its original's outcome and applied once. One :class:`DedupWindows` holds
the windows of every kind (dense pushes, row pushes) of every registration, so the rules that
carry or drop them apply to all kinds alike:

* a registration that continues another (``resume_worker_id``: a client that lost its
  registration and retries its last request under the new one; ``replace``: a successor that
  fences a live predecessor and resumes it) takes over the predecessor's windows, every kind;
* the windows of registrations the cluster forgot are dropped together.

Each kind keeps its own id space (a client may number dense and row pushes separately) and its
own bound (the oldest ids are forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Final, Generic, TypeVar, cast

__all__ = ["DEDUP_WINDOW", "DedupKind", "DedupWindows"]

#: Request ids remembered per registration and kind.
DEDUP_WINDOW: Final = 8192

_Outcome = TypeVar("_Outcome")


class DedupKind(str, Generic[_Outcome]):
    """A mutation kind's name (a plain ``str``), typed by the outcome its requests answer, so
    that :meth:`DedupWindows.get` and :meth:`DedupWindows.of` give that type back."""

    __slots__ = ()


class DedupWindows:
    """Per kind, per registration (worker id): request id -> the outcome answered.

    Args:
        kinds: The mutation kinds that carry request ids (e.g. ``"push"``, ``"push_rows"``).
        window: Ids remembered per registration and kind.
    """

    def __init__(self, kinds: Iterable[str], window: int = DEDUP_WINDOW) -> None:
        self.window = int(window)
        #: kind -> worker id -> request id -> outcome (each kind's outcomes of its one type,
        #: which only the typed kind's methods below store and hand out).
        self.kinds: dict[str, dict[str, OrderedDict[int, object]]] = {k: {} for k in kinds}

    def of(self, kind: DedupKind[_Outcome]) -> dict[str, OrderedDict[int, _Outcome]]:
        """Every registration's window of ``kind`` (checkpoints read and write it)."""
        return cast("dict[str, OrderedDict[int, _Outcome]]", self.kinds[kind])

    def get(self, kind: DedupKind[_Outcome], worker_id: str, request_id: int) -> _Outcome | None:
        """The outcome answered to ``request_id`` of this registration, or None."""
        seen = self.of(kind).get(worker_id)
        return None if seen is None else seen.get(request_id)

    def remember(
        self, kind: DedupKind[_Outcome], worker_id: str, request_id: int, outcome: _Outcome
    ) -> None:
        """Record an applied (or queued) request's outcome; forgets the oldest past the bound."""
        per_worker = self.of(kind)
        seen = per_worker.get(worker_id)
        if seen is None:  # (not setdefault: no new OrderedDict per request)
            seen = per_worker[worker_id] = OrderedDict()
        seen[request_id] = outcome
        if len(seen) > self.window:
            seen.popitem(last=False)

    def restore(
        self, kind: DedupKind[_Outcome], windows: dict[str, OrderedDict[int, _Outcome]]
    ) -> None:
        """Replace ``kind``'s windows (a checkpoint restore)."""
        self.kinds[kind] = cast("dict[str, OrderedDict[int, object]]", windows)

    def carry_over(
        self,
        old_worker_id: str,
        new_worker_id: str,
        keep: Callable[[object], bool] | None = None,
    ) -> None:
        """``new_worker_id`` continues ``old_worker_id``: it takes over every kind's window
        (merged, the new registration's own ids kept where both have one); with ``keep``, only
        the ids whose outcome it accepts."""
        for per_worker in self.kinds.values():
            old = per_worker.pop(old_worker_id, None)
            if old is None:
                continue
            if keep is not None:
                old = OrderedDict((rid, out) for rid, out in old.items() if keep(out))
            mine = per_worker.get(new_worker_id)
            if mine is not None:
                old.update(mine)
                while len(old) > self.window:
                    old.popitem(last=False)
            per_worker[new_worker_id] = old

    def forget_except(self, known: Iterable[str] | Mapping[str, object]) -> None:
        """Drop the windows of every registration not in ``known``."""
        keep = known if isinstance(known, dict) else set(known)
        for per_worker in self.kinds.values():
            for wid in [w for w in per_worker if w not in keep]:
                del per_worker[wid]
