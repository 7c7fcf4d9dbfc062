"""Imported by a worker's fork server that forks shard tasks only (``service.workers.task_server``): what a task
child runs (requantize's plan and write tasks, a calibrated job's serving shards) and nothing of model loading.

transformers' modeling stack and torchao (with the ``torch._dynamo`` both pull in) are most of a conversion
server's imports and no task uses them; a worker that only runs tasks (an extra requantize worker, a Slurm array
task) starts its first task without them. :mod:`service.workers.task_server_preload` imports this module too.
"""

from __future__ import annotations

import gc

# No collections while the preload imports: each full one walks everything imported so far (docs/service.md has
# what that cost); the end of this module collects once. task_server_preload, which imports this last, does the same.
gc.disable()

from converters.third_party_noise import silence_third_party_noise  # noqa: E402

silence_third_party_noise()  # before torch loads: its known start-up messages stay out of the log

import converters.model.sources  # noqa: E402,F401 - the hub client and the source resolution every task runs
import converters.modelfree.stored  # noqa: E402,F401 - torch, safetensors and the requantize task functions
import converters.pipeline.serving_export  # noqa: E402,F401 - a calibrated job's serving shard tasks
import service.workers.task_child  # noqa: E402,F401 - the task children's entry point

__all__: list[str] = []

# Last, and task_server_preload imports this module last: one collection frees what the imports left unreachable
# (frozen, it would stay for the server's life), then what they made is put out of the cyclic collector's reach
# (gc.freeze). A child's full collections then skip the server's objects instead of walking them and writing to
# their headers, which copied the pages holding them into every child (docs/service.md has what it saves). The
# children start with collections enabled again.
gc.collect()
gc.freeze()
gc.enable()
