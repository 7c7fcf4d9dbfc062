"""SmolLM2's conversion job te_current_mx_fp4 of real_decoder.JOB_PARTS (the checks: real_decoder.JobChecks)."""

from tests.converters.quality.real_decoder import JobChecks


class TestTeCurrentMxFp4Job(JobChecks):
    job = "te_current_mx_fp4"
