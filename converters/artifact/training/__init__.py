"""Ready-to-run training configs beside a training artifact (``training/``): Accelerate, Megatron-Bridge,
torchtitan, and a script that loads the artifact and trains one step."""

from converters.artifact.training.decisions import TrainingDecisions, read_training_decisions
from converters.artifact.training.writer import TRAINING_DIR, training_files, write_training_configs

__all__ = ["TRAINING_DIR", "TrainingDecisions", "read_training_decisions", "training_files", "write_training_configs"]
