"""A training step's peak GPU memory predicted from a model's config (the memory planner's model).

A prediction runs one training step of the model on the meta device (tigon.planning.memory_trace):
parameters, gradients, optimizer state, every activation and transient in autograd's order, with
HF's own code and, with ``tigon=True``, tigon's patched modules and ops. Nothing is downloaded but
the config, nothing is computed, and a step takes about a second for an 8B model.

The setup predicted is plain training as ``benchmarks/train_hf.py`` runs it: weights in ``dtype``
(bf16 by default), the optimizer's state in the weights' dtype (AdamW: two tensors a parameter,
updated in place by the fused step), SDPA attention without padding, gradients set to None after
each step. Checkpointing a decoder layer keeps only its input for the backward and runs its
forward again there. A step's FLOPs (FlopModel) give the tokens/s estimate the planner ranks by.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from tigon.hf_model import decoder_layers, set_checkpointing
from tigon.patching import PatchOptions, kernels_only, patch
from tigon.planning.memory_trace import Allocation, AllocationTracker, MemoryTrace, planning_step
from tigon.planning.model_config import check_causal_lm, load_config
from tigon.sizes import GiB

# The optimizers whose state a prediction allocates (_optimizer_state_tensors): AdamW keeps
# exp_avg and exp_avg_sq in the parameters' dtype; 8-bit AdamW both as one byte a value (fp32
# scales a 256-value block); plain SGD none.
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
# The tokens/s estimate that ranks the configurations that fit: a step costs its FLOPs at
# ASSUMED_FLOPS plus a fixed STEP_OVERHEAD_S (launches, the optimizer, the host), so that small
# batches are slower per token. Only the ranking uses them; the printed figure is labelled an estimate.
ASSUMED_FLOPS = 500e12
STEP_OVERHEAD_S = 0.03


def meta_model(config, dtype: torch.dtype = torch.bfloat16):
    """The causal LM of ``config`` on the meta device (no memory, no init), in train mode, with
    SDPA attention (eager where this transformers has no SDPA path for the family)."""
    from transformers import AutoModelForCausalLM

    check_causal_lm(config)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except ValueError as exc:  # this transformers has no SDPA path for the family (Gemma 2 in some)
            if "attention" not in str(exc):
                raise
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    model.config.use_cache = False
    return model.train()


@contextlib.contextmanager
def _unpacked_sequences():
    """HF's check for packed sequences in position_ids reads them (``.all()``), which meta
    tensors cannot answer; a planned batch is one sequence a row, the check's answer (None)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def checkpoint_count(checkpointing, n_layers: int) -> int:
    """Decoder layers a checkpointing setting ('none' / None / False, 'all' / True, a number) checkpoints."""
    if checkpointing is None or checkpointing is False or checkpointing == "none":
        return 0
    if checkpointing is True or checkpointing == "all":
        return n_layers
    if isinstance(checkpointing, int) and 0 <= checkpointing:
        return min(checkpointing, n_layers)
    raise ValueError(f"checkpointing must be 'none', 'all' or a number of layers, got {checkpointing!r}")


@dataclass
class StepMemory:
    """One predicted training step. Bytes: ``parameters``, ``gradients``, ``optimizer_state``;
    ``activations``: live at the end of the forward beyond those (what the backward keeps);
    ``layer_activations``: the most one decoder layer keeps; ``peak``: the step's highest
    allocated memory, reached in ``peak_phase`` (forward, backward, optimizer);
    ``largest``: the largest single allocation (logits, a chunk, an MLP intermediate)."""

    model_type: str
    batch: int
    seq: int
    tigon: bool
    checkpointed_layers: int
    n_layers: int
    optimizer: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    layer_activations: int
    peak: int
    peak_phase: str
    largest: Allocation | None
    trace: MemoryTrace
    flop_model: FlopModel

    @property
    def flops(self) -> float:
        return self.flop_model.flops(self.batch, self.seq, self.checkpointed_layers)

    @property
    def required(self) -> int:
        """What the GPU must hold for the step to run: the peak plus room for the largest single
        allocation again. The caching allocator can hold that much free but in pieces (HF's
        Gemma-2 step predicted at 71.5 GiB ran out of memory on an 79 GiB H100 asking for its
        15.6 GiB logits with 15 GiB reserved and unallocated); steps without large allocations
        (tigon's) pay little for it."""
        return self.peak + (self.largest.bytes if self.largest is not None else 0)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def estimated_tokens_per_s(self) -> float:
        return self.tokens / (STEP_OVERHEAD_S + self.flops / ASSUMED_FLOPS)

    @property
    def checkpointing(self) -> str:
        if self.checkpointed_layers == 0:
            return "none"
        if self.checkpointed_layers >= self.n_layers:
            return "every layer"
        return f"{self.checkpointed_layers} of {self.n_layers} layers"

    def breakdown(self) -> list[tuple[str, str]]:
        """(what, GiB) rows."""
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state),
                ("activations kept for the backward", self.activations),
                ("  of which one decoder layer", self.layer_activations)]
        out = [(name, f"{value / GiB:.2f}") for name, value in rows]
        out.append(("largest single allocation", f"{self.largest.bytes / GiB:.2f}" if self.largest else "-"))
        out.append(("peak", f"{self.peak / GiB:.2f}"))
        out.append(("  reached in the", self.peak_phase))
        return out

    def largest_description(self) -> str:
        if self.largest is None:
            return "none"
        a = self.largest
        return f"{a.op} [{' x '.join(map(str, a.shape))}] {str(a.dtype).removeprefix('torch.')} in the {a.phase}"


def _optimizer_state_tensors(params, optimizer: str):
    state = []
    for p in params:
        if optimizer == "adamw":
            state += [torch.empty_like(p), torch.empty_like(p)]
        elif optimizer == "adamw8bit":  # two uint8 states, fp32 scales per 256-value block
            state += [torch.empty(p.shape, dtype=torch.uint8, device=p.device) for _ in range(2)]
            state += [torch.empty(2 * math.ceil(p.numel() / 256), dtype=torch.float32, device=p.device)]
    return state


@dataclass(frozen=True)
class FlopModel:
    """What a step's matmul FLOPs follow: the decoder layers' weights, the output head's, the
    number of layers and the attention width (heads x head dim)."""

    layer_weights: int
    head_weights: int
    n_layers: int
    attention_width: int

    @classmethod
    def of(cls, model: nn.Module) -> FlopModel:
        text = model.config.get_text_config()
        layers = decoder_layers(model)
        heads = getattr(text, "num_attention_heads", 0) or 0
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
        head = model.get_output_embeddings()
        return cls(layer_weights=sum(p.numel() for layer in layers for p in layer.parameters() if p.ndim >= 2),
                   head_weights=head.weight.numel() if head is not None else 0, n_layers=len(layers),
                   attention_width=heads * head_dim)

    def flops(self, batch: int, seq: int, n_checkpointed: int = 0) -> float:
        """6 per weight and token (forward and backward); causal attention's QK^T and PV (2 * 2 *
        seq/2 * width a token and layer forward, 3x with the backward); a checkpointed layer's
        forward once more."""
        attention = 2 * 2 * (seq / 2) * self.attention_width * self.n_layers
        layer_forward = (2 * self.layer_weights + attention) / max(self.n_layers, 1)
        per_token = 6 * self.layer_weights + 3 * attention + 6 * self.head_weights + n_checkpointed * layer_forward
        return batch * seq * per_token


class StepTracer:
    """One meta-device model of a config (patched by tigon when ``tigon``), traced for as many
    (batch, seq, checkpointing) steps as asked: the model is built once."""

    def __init__(self, model_or_config, *, tigon: bool = True, optimizer: str = "adamw",
                 dtype: torch.dtype = torch.bfloat16, patch_options=None, progress=None):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
        self.config = load_config(model_or_config)
        self.model = meta_model(self.config, dtype)
        if tigon:
            options = kernels_only(patch_options or PatchOptions())
            patch(self.model, options)
        self.tigon, self.optimizer, self.progress = tigon, optimizer, progress
        self.layers = decoder_layers(self.model)
        self.flop_model = FlopModel.of(self.model)

    def trace(self, batch: int, seq: int, checkpointing=None, keep_timeline: bool = False) -> StepMemory:
        for name, value in (("batch", batch), ("seq", seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = self.model
        n_checkpointed = checkpoint_count(checkpointing, len(self.layers))
        set_checkpointing(model, n_checkpointed)
        params = [p for p in model.parameters() if p.requires_grad]
        tracker = AllocationTracker(keep_timeline=keep_timeline)
        for t in (*model.parameters(), *model.buffers()):
            tracker.track(t)
        static = tracker.current
        kept = []

        def before(module, args, kwargs):
            module._tigon_plan_bytes = tracker.current

        def after(module, args, kwargs, output):
            if torch.is_grad_enabled():
                kept.append(tracker.current - module._tigon_plan_bytes)

        hooks = [h for layer in self.layers for h in (layer.register_forward_pre_hook(before, with_kwargs=True),
                                                      layer.register_forward_hook(after, with_kwargs=True))]
        try:
            with planning_step(), _unpacked_sequences(), tracker:
                tracker.set_phase("optimizer")  # its state, live through the step (set up on the first)
                state = _optimizer_state_tensors(params, self.optimizer)
                state_bytes = tracker.current - static
                ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
                tracker.set_phase("forward")
                loss = model(input_ids=ids, labels=ids).loss
                activations = tracker.current - static - state_bytes
                tracker.set_phase("backward")
                loss.backward()
                del loss
                tracker.set_phase("optimizer")  # fused AdamW updates in place: nothing new is allocated
                for p in params:
                    p.grad = None
        finally:
            for h in hooks:
                h.remove()
        tracker.keep_timeline = False  # the step ends here; what follows is the trace's own cleanup
        del state
        if self.progress is not None:
            self.progress()
        trace = tracker.trace
        return StepMemory(model_type=self.config.model_type, batch=batch, seq=seq, tigon=self.tigon,
                          checkpointed_layers=n_checkpointed, n_layers=len(self.layers), optimizer=self.optimizer,
                          parameters=sum(p.numel() * p.element_size() for p in model.parameters()),
                          gradients=sum(p.numel() * p.element_size() for p in params), optimizer_state=state_bytes,
                          activations=activations, layer_activations=max(kept, default=0), peak=trace.peak,
                          peak_phase=trace.peak_phase, largest=trace.largest, trace=trace, flop_model=self.flop_model)


def predict_step(model_or_config, batch: int, seq: int, *, tigon: bool = True, checkpointing=None,
                 optimizer: str = "adamw", dtype: torch.dtype = torch.bfloat16, patch_options=None,
                 keep_timeline: bool = False) -> StepMemory:
    """Predict one training step's memory (a StepMemory) for ``batch`` sequences of ``seq``
    tokens: the config's causal LM in ``dtype``, patched by tigon when ``tigon``,
    ``checkpointing`` 'none' / 'all' / a number of decoder layers (spread evenly), ``optimizer``
    one of OPTIMIZERS."""
    tracer = StepTracer(model_or_config, tigon=tigon, optimizer=optimizer, dtype=dtype, patch_options=patch_options)
    return tracer.trace(batch, seq, checkpointing, keep_timeline)
