"""Memory planning: a training step's peak GPU memory predicted on the meta device (planner,
memory_trace), and the activation checkpointing ``tigon.patch(model, checkpointing=...)`` installs
(checkpointing)."""

from tigon.planning.planner import (
    ConfigError,
    FlopModel,
    MemoryPlan,
    Recommendation,
    StepMemory,
    default_gpu_memory,
    load_config,
    plan,
    predict_step,
    recommend,
    usable_bytes,
)

__all__ = ["ConfigError", "FlopModel", "MemoryPlan", "Recommendation", "StepMemory", "default_gpu_memory",
           "load_config", "plan", "predict_step", "recommend", "usable_bytes"]
