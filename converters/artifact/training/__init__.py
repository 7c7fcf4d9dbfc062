"""Ready-to-run training configs beside a training artifact (``training/``): Accelerate, Megatron-Bridge,
torchtitan, and a script that loads the artifact and trains one step."""

from converters.artifact.training.plan import TrainingPlan, read_training_plan
from converters.artifact.training.writer import TRAINING_DIR, training_files, write_training_configs

__all__ = ["TRAINING_DIR", "TrainingPlan", "read_training_plan", "training_files", "write_training_configs"]
