"""Analytic I/O model of LLM training (``lcache model``).

Turns a model shape and training settings into step time and the bytes each I/O class moves
(data reads, checkpoint writes and restarts, optimizer and activation offload), and judges
whether a node's SSDs keep up. Every formula cites its source; see ``docs/model.md``.

Example:
    >>> from lcache.model import config_from_preset, predict
    >>> p = predict(config_from_preset("llama3-8b", gpus=64))
    >>> round(p.checkpoint_bytes / 2**30, 1)
    104.7
"""

from lcache.model.config import TrainingConfig, build_config, config_from_preset, load_model_file
from lcache.model.hardware import GPUS, GpuSpec, get_gpu
from lcache.model.predict import CLASSES, ClassDemand, Prediction, predict
from lcache.model.presets import PRESETS, ModelShape, get_preset

__all__ = [
    "CLASSES",
    "GPUS",
    "PRESETS",
    "ClassDemand",
    "GpuSpec",
    "ModelShape",
    "Prediction",
    "TrainingConfig",
    "build_config",
    "config_from_preset",
    "get_gpu",
    "get_preset",
    "load_model_file",
    "predict",
]
