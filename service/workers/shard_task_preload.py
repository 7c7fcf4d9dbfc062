"""Imported by a worker's fork server that forks shard tasks only (``service.workers.task_server``): what a task
child runs (requantize's plan and write tasks, a calibrated job's serving shards) and nothing of model loading.

transformers' modeling stack and torchao (with the ``torch._dynamo`` both pull in) are most of a conversion
server's imports and no task uses them; a worker that only runs tasks (an extra requantize worker, a Slurm array
task) starts its first task without them. :mod:`service.workers.task_server_preload` imports this module too.
"""

from __future__ import annotations

from converters.frozen_imports import imports_frozen

# Collections held off while the preload imports, then one, then everything frozen (imports_frozen): a child's full
# collections skip the server's objects instead of walking them and writing to their headers, which copied the
# pages holding them into every child. When task_server_preload imports this module, last, its own use acts for both.
with imports_frozen():
    from converters.third_party_noise import silence_third_party_noise

    silence_third_party_noise()  # before torch loads: its known start-up messages stay out of the log

    import converters.model.sources  # noqa: F401 - the hub client and the source resolution every task runs
    import converters.modelfree.stored  # noqa: F401 - torch, safetensors and the requantize task functions
    import converters.pipeline.serving_export  # noqa: F401 - a calibrated job's serving shard tasks
    import service.workers.task_child  # noqa: F401 - the task children's entry point

__all__: list[str] = []
