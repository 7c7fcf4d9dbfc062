"""The durable job store: jobs and their transitions, event logs, worker liveness, stage timings."""

from service.store.job_store import JobBusy, JobLost, JobStore

__all__ = ["JobBusy", "JobLost", "JobStore"]
