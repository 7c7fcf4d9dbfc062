"""The job status machine: exactly the documented transitions are allowed."""

from __future__ import annotations

import itertools

import pytest

from service.errors import InvalidTransition
from service.jobs import TRANSITIONS, JobStatus, transition

Q, R, S, F, CG, C = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED,
                     JobStatus.CANCELLING, JobStatus.CANCELLED)

ALLOWED = {
    (Q, R), (Q, C),              # claimed; cancelled before a worker got it
    (R, S), (R, F), (R, CG),     # finished; failed; cancel requested
    (R, Q),                      # worker lost or shut down: requeued
    (CG, C), (CG, F),            # the worker stopped it; or gave up
}


@pytest.mark.parametrize("current,target", list(itertools.product(JobStatus, JobStatus)))
def test_transition_table(current: JobStatus, target: JobStatus) -> None:
    if (current, target) in ALLOWED:
        assert transition(current, target) is target
    else:
        with pytest.raises(InvalidTransition):
            transition(current, target)


@pytest.mark.parametrize("status", list(JobStatus))
def test_finished_statuses_are_exactly_the_documented_ones(status: JobStatus) -> None:
    assert status.is_finished == (status in {S, F, C})


@pytest.mark.parametrize("status", [s for s in JobStatus if not s.is_finished])
def test_every_unfinished_status_can_still_end_cancelled_or_failed(status: JobStatus) -> None:
    # a job a user cancels, or whose worker gives up, must always have a way to a final status
    seen, todo = set(), [status]
    while todo:
        current = todo.pop()
        seen.add(current)
        todo += [t for t in TRANSITIONS[current] if t not in seen]
    assert {C, F} <= seen


def test_refusal_says_the_job_already_finished() -> None:
    with pytest.raises(InvalidTransition, match="already succeeded"):
        transition(S, CG)
