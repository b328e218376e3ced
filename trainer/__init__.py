"""The PyTorch trainer: one `TrainingConfig` in, one trained model and its metrics out. Imports torch and numpy only."""

from __future__ import annotations

from trainer.config import ConfigError, TrainingConfig
from trainer.loop import NullReporter, Reporter, TrainResult, train
from trainer.tasks import Task, load_task

__all__ = ["ConfigError", "NullReporter", "Reporter", "Task", "TrainResult", "TrainingConfig", "load_task", "train"]
