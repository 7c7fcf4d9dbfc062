"""SmolLM2's conversion job ao_tensorwise of real_decoder.JOB_PARTS (the checks: real_decoder.JobChecks)."""

from tests.converters.quality.real_decoder import JobChecks


class TestAoTensorwiseJob(JobChecks):
    job = "ao_tensorwise"
