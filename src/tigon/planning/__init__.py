"""Memory planning: a training step's peak GPU memory predicted on the meta device from a model's
config (model_config, prediction, memory_trace), the batch size and checkpointing that fit a budget
(planner), and the activation checkpointing ``tigon.patch(model, checkpointing=...)`` installs
(checkpointing)."""

from tigon.planning.model_config import ConfigError, load_config
from tigon.planning.planner import MemoryPlan, Recommendation, default_gpu_memory, plan, recommend, usable_bytes
from tigon.planning.prediction import FlopModel, StepMemory, predict_step

__all__ = ["ConfigError", "FlopModel", "MemoryPlan", "Recommendation", "StepMemory", "default_gpu_memory",
           "load_config", "plan", "predict_step", "recommend", "usable_bytes"]
