"""Where a built-in job's worker continues when its name already completed iterations.

The cluster counts, per worker name, the iterations (``clock()`` calls) its registrations
completed, across re-registration and replacement
(:meth:`~paramserver.worker_client.WorkerClient.progress`). The built-in jobs train a plan of
``epochs`` x ``steps_per_epoch`` iterations, one batch each, in an order that depends only on
the seed, the epoch and the worker; so a worker that restarts, or replaces a lost one under its
name, skips the iterations done and trains the rest in the order an uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ResumePoint", "resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """The first iteration of a plan still to train.

    Attributes:
        epoch: Its epoch (0-based; ``epochs`` when the whole plan is done).
        step: Its step within that epoch (0-based).
        skipped: Iterations of the plan already done (trained by earlier registrations).
        planned: Iterations of the whole plan (``epochs * steps_per_epoch``).
    """

    epoch: int
    step: int
    skipped: int
    planned: int

    def steps_of(self, epoch: int, steps_per_epoch: int) -> range:
        """The steps of ``epoch`` left to train: all of a later epoch, none of an earlier."""
        if epoch < self.epoch:
            return range(0)
        return range(self.step if epoch == self.epoch else 0, steps_per_epoch)


def resume_point(done: int, epochs: int, steps_per_epoch: int) -> ResumePoint:
    """Where a plan of ``epochs`` x ``steps_per_epoch`` iterations continues after ``done``
    of them (the name's completed iterations; more than planned counts as all of them).

    Raises:
        ValueError: a negative ``done`` or ``epochs``, or ``steps_per_epoch`` < 1.
    """
    if done < 0 or epochs < 0 or steps_per_epoch < 1:
        raise ValueError(
            f"resume_point needs done >= 0, epochs >= 0 and steps_per_epoch >= 1; got "
            f"{done}, {epochs}, {steps_per_epoch}"
        )
    planned = epochs * steps_per_epoch
    skipped = min(done, planned)
    epoch, step = divmod(skipped, steps_per_epoch)
    return ResumePoint(epoch, step, skipped, planned)
