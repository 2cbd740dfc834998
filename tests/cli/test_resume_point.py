"""Where a built-in job's worker resumes (paramserver.cli.demos.resume): the iterations left
after ``done`` of a plan are exactly the tail of the uninterrupted plan, enumerated here."""

from __future__ import annotations

import pytest

from paramserver.cli.demos.resume import resume_point

pytestmark = pytest.mark.timeout(30)


def plan(epochs: int, steps_per_epoch: int) -> list[tuple[int, int]]:
    """Every (epoch, step) of an uninterrupted run, in order."""
    return [(e, s) for e in range(epochs) for s in range(steps_per_epoch)]


@pytest.mark.parametrize("epochs", [0, 1, 2, 5])
@pytest.mark.parametrize("steps_per_epoch", [1, 3, 22])
def test_the_resumed_iterations_are_the_uninterrupted_plans_tail(
    epochs: int, steps_per_epoch: int
) -> None:
    full = plan(epochs, steps_per_epoch)
    for done in range(len(full) + 3):  # more than planned: a name that did it all already
        at = resume_point(done, epochs, steps_per_epoch)
        left = [(e, s) for e in range(epochs) for s in at.steps_of(e, steps_per_epoch)]
        assert left == full[done:], done
        assert at.skipped == min(done, len(full))
        assert at.planned == len(full)
        if done < len(full):
            assert (at.epoch, at.step) == full[done]
        else:
            assert (at.epoch, at.step) == (epochs, 0)


@pytest.mark.parametrize(("done", "epochs", "steps"), [(-1, 2, 3), (0, -1, 3), (0, 2, 0)])
def test_refuses_a_plan_that_cannot_be(done: int, epochs: int, steps: int) -> None:
    with pytest.raises(ValueError, match="resume_point needs"):
        resume_point(done, epochs, steps)
