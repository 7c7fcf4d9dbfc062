"""Imported by a worker's fork server that forks conversions (``service.workers.task_server``), before it forks:
with :mod:`service.workers.shard_task_preload`, the modules of ``service`` that load torch on import, so that every
conversion and task child starts with it loaded. Nothing else imports them; the service itself stays free of torch
(the API, the worker loop).

A spawned conversion child imported torch, the pipeline, transformers' auto classes and torchao's float8 before its
first step; forked from here, each job after a worker's first starts with them (docs/service.md has the seconds).
"""

from __future__ import annotations

from converters.frozen_imports import imports_frozen

with imports_frozen():  # held off while importing, then frozen: see shard_task_preload
    from converters.third_party_noise import silence_third_party_noise

    silence_third_party_noise()  # before torch and torchao load: their known start-up messages stay out of the log

    import torchao.float8  # noqa: F401 - the ao backend's modules and the casts they register with torch
    import transformers  # noqa: F401 - the model loading of every calibrated job (its auto classes below)
    import transformers.modeling_utils  # noqa: F401 - what every model class imports; the auto classes do not
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401 - resolved lazily: import them now

    import converters.distributed  # noqa: F401 - the conversion pipeline (run_ranked_conversion)
    import service.workers.child  # noqa: F401 - the conversion children's entry point
    import service.workers.serving_shards  # noqa: F401 - a conversion's serving shards queued as tasks
    import service.workers.shard_task_preload  # noqa: F401 - what a task child runs

__all__: list[str] = []
