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
def test_finished_statuses_have_no_way_out(status: JobStatus) -> None:
    assert status.is_finished == (status in {S, F, C})
    assert status.is_finished == (not TRANSITIONS[status])


def test_refusal_says_the_job_already_finished() -> None:
    with pytest.raises(InvalidTransition, match="already succeeded"):
        transition(S, CG)
