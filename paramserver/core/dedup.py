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
from collections.abc import Callable, Iterable
from typing import Any, Final

__all__ = ["DEDUP_WINDOW", "DedupWindows"]

#: Request ids remembered per registration and kind.
DEDUP_WINDOW: Final = 8192


class DedupWindows:
    """Per kind, per registration (worker id): request id -> the outcome answered.

    Args:
        kinds: The mutation kinds that carry request ids (e.g. ``"push"``, ``"push_rows"``).
        window: Ids remembered per registration and kind.
    """

    def __init__(self, kinds: Iterable[str], window: int = DEDUP_WINDOW) -> None:
        self.window = int(window)
        self.kinds: dict[str, dict[str, OrderedDict[int, Any]]] = {k: {} for k in kinds}

    def of(self, kind: str) -> dict[str, OrderedDict[int, Any]]:
        """Every registration's window of ``kind`` (checkpoints read and write it)."""
        return self.kinds[kind]

    def get(self, kind: str, worker_id: str, request_id: int) -> Any | None:
        """The outcome answered to ``request_id`` of this registration, or None."""
        seen = self.kinds[kind].get(worker_id)
        return None if seen is None else seen.get(request_id)

    def remember(self, kind: str, worker_id: str, request_id: int, outcome: Any) -> None:
        """Record an applied (or queued) request's outcome; forgets the oldest past the bound."""
        per_worker = self.kinds[kind]
        seen = per_worker.get(worker_id)
        if seen is None:  # (not setdefault: no new OrderedDict per request)
            seen = per_worker[worker_id] = OrderedDict()
        seen[request_id] = outcome
        if len(seen) > self.window:
            seen.popitem(last=False)

    def restore(self, kind: str, windows: dict[str, OrderedDict[int, Any]]) -> None:
        """Replace ``kind``'s windows (a checkpoint restore)."""
        self.kinds[kind] = windows

    def carry_over(
        self,
        old_worker_id: str,
        new_worker_id: str,
        keep: Callable[[Any], bool] | None = None,
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

    def forget_except(self, known: Iterable[str] | dict[str, Any]) -> None:
        """Drop the windows of every registration not in ``known``."""
        keep = known if isinstance(known, dict) else set(known)
        for per_worker in self.kinds.values():
            for wid in [w for w in per_worker if w not in keep]:
                del per_worker[wid]
