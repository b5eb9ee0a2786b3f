"""``tigon.patch(model, checkpointing=...)``: which decoder layers HF's activation checkpointing
recomputes, set before each training forward (installed on a patched model by ``tigon.patch``).

- ``"auto"``: at the first training forward of each (batch, seq) shape the planner
  (tigon.planning.planner) predicts the step's peak with no layer checkpointed and picks the fewest
  layers (spread evenly) whose checkpointing keeps it within ``memory_budget``; none when the
  whole step fits, every layer when nothing less does (with a warning when even that does not).
- ``"none"`` / ``"all"`` / a number of layers: that many, every forward.

The choice is re-applied when something else changed the layers' flags (HF Trainer's
``gradient_checkpointing=True`` enables every layer before training starts), so Trainer's
argument and this option work together: this option decides which layers.
"""

from __future__ import annotations

import inspect
import logging
import warnings

import torch
from torch import nn

from tigon.hf_model import checkpointed_indices, decoder_layers, set_checkpointing
from tigon.patching import PatchOptions, PatchReport, set_instance_attribute
from tigon.planning.planner import default_gpu_memory, recommend, usable_bytes
from tigon.planning.prediction import checkpoint_count
from tigon.sizes import GiB, parse_bytes

log = logging.getLogger("tigon")


class CheckpointingPolicy:
    """The setting, the budget (bytes; None: the model's GPU's, as tigon.planning.planner.usable_bytes),
    the patch options to plan with, and the choice made for each (batch, seq)."""

    def __init__(self, setting, memory_budget, patch_options):
        self.setting = setting
        self.budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        self.patch_options = patch_options
        self.chosen: dict[tuple[int, int], int] = {}
        self.layers = None  # the model's decoder layers, found at the first training forward

    def layers_for(self, model, batch: int, seq: int, n_layers: int) -> int:
        if self.setting != "auto":
            return checkpoint_count(self.setting, n_layers)
        key = (batch, seq)
        if key not in self.chosen:
            self.chosen[key] = self._plan(model, batch, seq, n_layers)
        return self.chosen[key]

    def _plan(self, model, batch, seq, n_layers) -> int:
        budget = self.budget
        if budget is None:
            gpu = default_gpu_memory()
            if gpu is None:
                raise ValueError("checkpointing='auto' needs memory_budget (bytes or '70GiB') where no CUDA GPU is "
                                 "visible")
            budget = usable_bytes(gpu)
        dtype = next(model.parameters()).dtype
        rec = recommend(model.config, seq, budget, tigon=True, batch=batch, dtype=dtype,
                        patch_options=self.patch_options)
        if rec is None:
            warnings.warn(f"tigon: batch {batch} x {seq} is predicted not to fit {budget / GiB:.1f} GiB even with "
                          "every decoder layer checkpointed; checkpointing every layer", stacklevel=4)
            return n_layers
        log.info("tigon: checkpointing %d of %d decoder layers for batch %d x %d (predicted peak %.2f GiB within "
                 "%.2f GiB)", rec.step.checkpointed_layers, n_layers, batch, seq, rec.step.peak / GiB, budget / GiB)
        return rec.step.checkpointed_layers


def _input_shape(args, kwargs):
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor):
            return tuple(x.shape[:2])
    if args and isinstance(args[0], torch.Tensor):
        return tuple(args[0].shape[:2])
    return None


@torch.compiler.disable
def _apply(policy: CheckpointingPolicy, model, args, kwargs) -> None:
    if not (model.training and torch.is_grad_enabled()):
        return
    shape = _input_shape(args, kwargs)
    if shape is None or len(shape) < 2:
        return
    if policy.layers is None:  # once: walking every module each forward would cost host time a step
        policy.layers = decoder_layers(model)
    layers = policy.layers
    n = policy.layers_for(model, shape[0], shape[1], len(layers))
    wanted = set(checkpointed_indices(len(layers), n))
    if any(bool(layer.gradient_checkpointing) != (i in wanted) for i, layer in enumerate(layers)):
        set_checkpointing(model, n)


def make_checkpointing_forward(inner, policy: CheckpointingPolicy):
    """A model forward that applies ``policy`` to the decoder layers, then runs ``inner`` (the
    forward before, bound); it shows ``inner``'s signature (HF Trainer reads it)."""

    def forward(self, *args, **kwargs):
        _apply(policy, self, args, kwargs)
        return inner(*args, **kwargs)

    signature = inspect.signature(inner)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    forward._tigon = "checkpointing"
    return forward


def install_checkpointing(model: nn.Module, opts: PatchOptions, report: PatchReport) -> None:
    """``opts.checkpointing`` on a built, patched model (nothing when None): its forward sets the
    decoder layers' flags first; the report gains a line and the undo."""
    if opts.checkpointing is None:
        return
    if not decoder_layers(model):
        raise ValueError(f"checkpointing={opts.checkpointing!r}: {type(model).__name__} has no decoder layers HF "
                         "can checkpoint")
    policy = CheckpointingPolicy(opts.checkpointing, opts.memory_budget, opts)
    set_instance_attribute(model, "forward", make_checkpointing_forward(model.forward, policy), report)
    what = {"auto": "auto (the fewest layers the memory planner finds fit, per batch shape)", "none": "none",
            "all": "every decoder layer"}.get(opts.checkpointing, f"{opts.checkpointing} decoder layers")
    report.replaced.append(("checkpointing", what, "1"))
