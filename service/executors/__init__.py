"""Executors: who runs the jobs of the store when the embedded local worker pool (``service.workers.pool``) does not.

``FP8FORGE_EXECUTOR=slurm`` (``service.executors.slurm_dispatch``) submits each queued job to a Slurm cluster: a
calibrated job as one batch job whose ranks ``srun`` starts, a requantize job as a Slurm array whose tasks claim
that job's shard tasks as local workers do. The store stays the one record of state, events and artifacts.
"""
