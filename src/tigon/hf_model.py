"""Hugging Face model structure that patching and planning both read: the decoder layers HF
checkpoints, and which of them to checkpoint."""

from __future__ import annotations

import math

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules HF checkpoints one at a time (its GradientCheckpointingLayer instances), in order."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: the layers carry the flag themselves
        GradientCheckpointingLayer = ()
    layers = [m for m in model.modules()
              if (GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer))
              or (not GradientCheckpointingLayer and hasattr(m, "gradient_checkpointing") and m is not model)]
    return layers


def checkpointed_indices(n_layers: int, n_checkpointed: int) -> list[int]:
    """Which of ``n_layers`` layers to checkpoint when checkpointing ``n_checkpointed`` of them:
    spread evenly (every k-th layer), the first included."""
    if n_checkpointed <= 0:
        return []
    if n_checkpointed >= n_layers:
        return list(range(n_layers))
    return sorted({math.floor(i * n_layers / n_checkpointed) for i in range(n_checkpointed)})


def set_checkpointing(model: nn.Module, n_checkpointed: int) -> list[int]:
    """Checkpoint ``n_checkpointed`` decoder layers of ``model`` (0: none; every layer at least
    its count), spread evenly; HF's checkpointing function installed first where it is missing
    (non-reentrant). Returns the checkpointed layers' indices."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers HF can checkpoint")
    chosen = checkpointed_indices(len(layers), n_checkpointed)
    if chosen and not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers):
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    wanted = set(chosen)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i in wanted
    return chosen
