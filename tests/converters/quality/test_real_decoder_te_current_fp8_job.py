"""SmolLM2's conversion job te_current_fp8 of real_decoder.JOB_PARTS (the checks: real_decoder.JobChecks)."""

from tests.converters.quality.real_decoder import JobChecks


class TestTeCurrentFp8Job(JobChecks):
    job = "te_current_fp8"
