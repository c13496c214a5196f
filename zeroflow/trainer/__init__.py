"""The trainer behind ``python -m zeroflow.train``."""

from zeroflow.trainer.evaluation import TrainResult
from zeroflow.trainer.loop import TrainingDiverged, train
from zeroflow.trainer.setup import Run, build_run

__all__ = ["train", "TrainResult", "TrainingDiverged", "Run", "build_run"]
