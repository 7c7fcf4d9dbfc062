"""Imported by the task children's fork server alone (``service.workers.task_server``), before it forks: the one
module of ``service`` that loads torch on import, so that every task child starts with it loaded. Nothing else
imports it; the service itself stays free of torch (the API, the worker loop).
"""

from __future__ import annotations

from converters.third_party_noise import silence_third_party_noise

silence_third_party_noise()  # before torch and torchao load: their known start-up messages stay out of the log

import converters.model.sources  # noqa: E402,F401 - the hub client and the source resolution every task runs
import converters.modelfree.stored  # noqa: E402,F401 - torch, safetensors and the task functions
import converters.pipeline.serving_export  # noqa: E402,F401 - a calibrated job's serving shard tasks
import service.workers.task_child  # noqa: E402,F401 - the children's entry point

__all__: list[str] = []
