"""The memory planner: a training step's peak GPU memory predicted from a model's config, and
the batch size and activation checkpointing that fit a memory budget at the best tokens/s.

A prediction runs one training step of the model on the meta device (tigon.planning.memory_trace):
parameters, gradients, optimizer state, every activation and transient in autograd's order, with
HF's own code and, with ``tigon=True``, tigon's patched modules and ops. Nothing is downloaded but
the config, nothing is computed, and a step takes about a second for an 8B model.

The setup predicted is plain training as ``benchmarks/train_hf.py`` runs it: weights in ``dtype``
(bf16 by default), the optimizer's state in the weights' dtype (AdamW: two tensors a parameter,
updated in place by the fused step), SDPA attention without padding, gradients set to None after
each step. Checkpointing a decoder layer keeps only its input for the backward and runs its
forward again there.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from tigon.hf_model import decoder_layers, set_checkpointing
from tigon.patching import PatchOptions, kernels_only, patch
from tigon.planning.memory_trace import Allocation, AllocationTracker, MemoryTrace, planning_step
from tigon.shapes import SHAPES, shape_config
from tigon.sizes import GiB, parse_bytes

# The optimizers whose state a prediction allocates (_optimizer_state_tensors): AdamW keeps
# exp_avg and exp_avg_sq in the parameters' dtype; 8-bit AdamW both as one byte a value (fp32
# scales a 256-value block); plain SGD none.
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
# Of the budget, what allocations may take: the rest is the CUDA context, cuBLAS's and NCCL's
# workspaces outside the allocator, and room for the caching allocator's fragmentation.
USABLE_FRACTION = 0.92
# The tokens/s estimate that ranks the configurations that fit: a step costs its FLOPs at
# ASSUMED_FLOPS plus a fixed STEP_OVERHEAD_S (launches, the optimizer, the host), so that small
# batches are slower per token. Only the ranking uses them; the printed figure is labelled an estimate.
ASSUMED_FLOPS = 500e12
STEP_OVERHEAD_S = 0.03


class ConfigError(ValueError):
    """A model argument that gives no config to plan: a path that does not exist, a folder
    without config.json, a file that is not a model's config, an unknown shape name, a hub id
    the hub (offline: the local cache) does not have, or a config with no causal LM. Its message
    is one line for the user (``tigon`` prints it as the model argument's error)."""


# A hub id: namespace/name (huggingface.co/<namespace>/<name>). A name without a namespace is a
# shape name or an error, never a hub lookup: a typo of a shape fails at once, offline.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# How long the check that the hub answers may wait before a hub id is looked up in the local
# cache only (huggingface_hub retries a failing request for about 25 s).
HUB_PROBE_TIMEOUT_S = 5.0
_MODEL_FORMS = "a shape name, a folder with config.json, a config.json or a hub id like meta-llama/Llama-3.2-1B"


def load_config(model_or_config):
    """A transformers config from a config object, a built model, a shape name of
    tigon.shapes (offline), a folder or config.json path, or a hub id ``namespace/name``
    (only its config.json is fetched; from the local cache when HF_HUB_OFFLINE is set or the
    hub does not answer). A name that gives no config raises ConfigError."""
    from transformers import PretrainedConfig


    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    if isinstance(model_or_config, nn.Module) and hasattr(model_or_config, "config"):
        return model_or_config.config
    if isinstance(model_or_config, str) and model_or_config in SHAPES:
        return shape_config(model_or_config)
    if not isinstance(model_or_config, (str, os.PathLike)):
        raise TypeError(f"model must be a transformers config, a model, a config path or a hub id, "
                        f"got {type(model_or_config).__name__}")
    name = os.fspath(model_or_config)
    path = os.path.expanduser(name)
    if name and os.path.exists(path):
        return _local_config(path)
    if isinstance(model_or_config, str) and _HUB_ID.fullmatch(name):
        return _hub_config(name)
    if not name or isinstance(model_or_config, os.PathLike) or "/" in name or os.sep in name \
            or name.startswith((".", "~")) or name.endswith(".json"):
        raise ConfigError(f"no such file or folder: {name!r}; give {_MODEL_FORMS}")
    raise ConfigError(f"unknown shape {name!r} (choose from {', '.join(map(repr, SHAPES))}), or give a folder "
                      f"with config.json, a config.json or a hub id with its namespace, like meta-llama/Llama-3.2-1B")


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _local_config(path: str):
    """The config in ``path``: a folder holding config.json, or a config file."""
    import json

    import transformers
    from huggingface_hub import errors as hub_errors
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    folder = os.path.isdir(path)
    file = os.path.join(path, "config.json") if folder else path
    if not os.path.isfile(file):
        raise ConfigError(f"{path} has no config.json; give {_MODEL_FORMS}" if folder else
                          f"{path} is not a file or a folder")
    try:
        with open(file, "rb") as f:
            data = json.loads(f.read())
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{file} is not valid JSON ({_one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file} holds a JSON {type(data).__name__}, not a model's config (an object with a "
                          f"\"model_type\")")
    model_type = data.get("model_type")
    if not model_type:
        raise ConfigError(f"{file} has no \"model_type\" (the model's family, e.g. \"llama\"): is it a "
                          f"transformers model's config.json?")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{file}: model_type {model_type!r} is not a model family transformers "
                          f"{transformers.__version__} knows")
    refused = (ValueError, TypeError, getattr(hub_errors, "StrictDataclassError", ValueError))
    try:  # transformers checks the values (types, ranges) as it builds the config
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(file))
                                          if os.path.basename(file) == "config.json" else file)
    except refused as exc:
        raise ConfigError(f"{file}: transformers refuses the config: {_one_line(exc)}") from exc


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it at import, or as set since."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(f and f.strip().upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _hub_unreachable() -> str | None:
    """Why the hub (or the proxy to it) takes no connection within HUB_PROBE_TIMEOUT_S; None when it does."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxy = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxy.hostname, proxy.port or (443 if proxy.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:  # socket.gaierror (no DNS), TimeoutError, ConnectionRefusedError, ...
        return f"{host}:{port}: {exc.strerror or str(exc) or type(exc).__name__}"
    return None


def _hub_config(repo_id: str):
    """The config of the hub repository ``repo_id``: downloaded (or refreshed) when the hub
    answers, else from the local cache."""
    from huggingface_hub import errors, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except errors.HFValidationError as exc:
        raise ConfigError(f"{repo_id!r} is not a folder here nor a valid hub id ({_one_line(exc)})") from exc
    cached = cached if isinstance(cached, str) else None
    offline = _hub_offline()
    unreachable = None if offline else _hub_unreachable()
    if offline or unreachable:
        if cached is None:
            why = "HF_HUB_OFFLINE is set: unset it to download the config" if offline else \
                f"the hub does not answer ({unreachable}): check the connection"
            raise ConfigError(f"{repo_id!r} is not a folder here nor in the hub cache, and {why}, or give a folder "
                              f"with config.json")
        file = cached
    else:
        try:
            file = hf_hub_download(repo_id, "config.json")
        except errors.GatedRepoError as exc:
            raise ConfigError(f"{repo_id} is gated on the hub: accept its terms at https://huggingface.co/{repo_id} "
                              f"and log in (`hf auth login`)") from exc
        except errors.RepositoryNotFoundError as exc:
            raise ConfigError(f"{repo_id!r} is not a folder here nor a model on the hub (a private one needs "
                              f"`hf auth login`)") from exc
        except errors.LocalEntryNotFoundError as exc:  # the download failed and nothing is cached
            raise ConfigError(f"could not download {repo_id}'s config.json from the hub: {_one_line(exc)}") from exc
        except errors.EntryNotFoundError as exc:
            raise ConfigError(f"{repo_id} on the hub has no config.json (is it a transformers model?)") from exc
        except errors.HfHubHTTPError as exc:
            raise ConfigError(f"the hub refused {repo_id}'s config.json: {_one_line(exc)}") from exc
    config = _local_config(file)
    config._name_or_path = repo_id
    return config


def check_causal_lm(config) -> None:
    """ConfigError unless transformers has a causal LM (AutoModelForCausalLM) for ``config``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"the planner predicts causal language models (AutoModelForCausalLM); model_type "
                          f"{config.model_type!r} is not one (vision-language models are not planned yet)")


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


@dataclass
class Recommendation:
    """The batch size and checkpointing with the best estimated tokens/s within the budget."""

    step: StepMemory
    budget: int

    def __str__(self):
        s = self.step
        return (f"batch {s.batch} x {s.seq} tokens, checkpointing {s.checkpointing}: peak {s.peak / GiB:.2f} GiB "
                f"(+ {(s.required - s.peak) / GiB:.2f} allocator headroom) of {self.budget / GiB:.2f} usable, "
                f"~{s.estimated_tokens_per_s / 1e3:.0f}K tokens/s (estimate)")


def usable_bytes(gpu_memory) -> int:
    """What allocations may take of a GPU with ``gpu_memory`` (USABLE_FRACTION of it)."""
    return int(parse_bytes(gpu_memory, "gpu_memory") * USABLE_FRACTION)


def default_gpu_memory() -> int | None:
    """The current CUDA device's total memory, or None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def _largest_fitting_batch(tracer: StepTracer, seq: int, n: int, budget: int, max_batch: int):
    """(largest batch whose step fits ``budget`` with ``n`` checkpointed layers, its step, the
    step at about half that batch) by doubling then bisection; (0, None, None) when batch 1 does not fit."""
    steps = {}

    def fits(b):
        steps[b] = tracer.trace(b, seq, n)
        return steps[b].required <= budget

    if not fits(1):
        return 0, None, None
    lo, hi = 1, 2
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)
    while hi - lo > max(1, lo // 64):  # within 1.5%: the tokens/s estimate is no finer
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    half = min(steps, key=lambda b: abs(b - lo / 2))
    return lo, steps[lo], steps[half]


def recommend(model_or_config, seq: int, budget: int, *, tigon: bool = True, batch: int | None = None,
              optimizer: str = "adamw", dtype: torch.dtype = torch.bfloat16, max_batch: int = 4096,
              patch_options=None, progress=None) -> Recommendation | None:
    """The (batch, checkpointed decoder layers) with the best estimated tokens/s whose
    predicted peak fits ``budget`` bytes (the batch fixed when given); None when nothing fits.
    The largest batch is found by tracing with no layer and with every layer checkpointed; the
    peak is affine in the number of checkpointed layers (each keeps the same) and, at those
    batch sizes, in the batch, which places the layer counts between; the choice is traced to
    confirm it. ``progress``: called after each traced step."""
    tracer = StepTracer(model_or_config, tigon=tigon, optimizer=optimizer, dtype=dtype, patch_options=patch_options,
                        progress=progress)
    n_layers = len(tracer.layers)
    if batch is not None:  # the fewest checkpointed layers that fit
        none, every = tracer.trace(batch, seq, 0), tracer.trace(batch, seq, n_layers)
        if none.required <= budget:
            return Recommendation(none, budget)
        if every.required > budget:
            return None
        n = max(1, math.ceil(n_layers * (none.required - budget) / max(none.required - every.required, 1)))
        while n < n_layers:
            step = tracer.trace(batch, seq, n)
            if step.required <= budget:
                return Recommendation(step, budget)
            n += 1
        return Recommendation(every, budget)
    b_none, top_none, half_none = _largest_fitting_batch(tracer, seq, 0, budget, max_batch)
    b_all, top_all, half_all = _largest_fitting_batch(tracer, seq, n_layers, budget, max_batch)
    if top_all is None and top_none is None:
        return None

    def affine(top, half):  # required(b) = a + b * slope from two traced batch sizes
        slope = (top.required - half.required) / (top.batch - half.batch) if top.batch != half.batch else 0.0
        return top.required - top.batch * slope, slope

    candidates = [(b_none, 0)] if b_none else []
    if top_all is not None:
        candidates.append((b_all, n_layers))
    if top_none is not None and top_all is not None and b_all > b_none + 1:
        (a0, s0), (a1, s1) = affine(top_none, half_none), affine(top_all, half_all)
        for n in range(1, n_layers):
            f = n / n_layers
            a, slope = a0 + f * (a1 - a0), s0 + f * (s1 - s0)
            b = min(max_batch, int((budget - a) // slope)) if slope > 0 else max_batch
            if b > b_none:
                candidates.append((b, n))

    def speed(c):
        b, n = c
        return b * seq / (STEP_OVERHEAD_S + tracer.flop_model.flops(b, seq, n) / ASSUMED_FLOPS)

    for b, n in sorted(candidates, key=speed, reverse=True):
        if (b, n) == (b_none, 0):
            return Recommendation(top_none, budget)
        if (b, n) == (b_all, n_layers):
            return Recommendation(top_all, budget)
        step = tracer.trace(b, seq, n)
        while step.required > budget and b > 1:  # the affine estimate was short: step down
            b -= max(1, b // 32)
            step = tracer.trace(b, seq, n)
        if step.required <= budget and speed((b, n)) >= speed((b_none, 0)):
            return Recommendation(step, budget)
    return Recommendation(top_none if top_none is not None else top_all, budget)


@dataclass
class MemoryPlan:
    """``tigon plan``'s answer: the predicted step at the batch asked for (or the recommended
    one) for HF and for HF + tigon, and each one's recommendation within the budget."""

    model: str
    seq: int
    budget: int | None
    hf: StepMemory | None
    tigon: StepMemory | None
    hf_recommendation: Recommendation | None
    tigon_recommendation: Recommendation | None

    def to_dict(self) -> dict:
        """The numbers as plain values (bytes), for JSON."""
        def step(s):
            if s is None:
                return None
            return dict(batch=s.batch, seq=s.seq, tigon=s.tigon, checkpointed_layers=s.checkpointed_layers,
                        n_layers=s.n_layers, optimizer=s.optimizer, parameters=s.parameters, gradients=s.gradients,
                        optimizer_state=s.optimizer_state, activations=s.activations,
                        layer_activations=s.layer_activations, peak=s.peak, peak_phase=s.peak_phase,
                        largest=s.largest_description(), estimated_tokens_per_s=s.estimated_tokens_per_s)

        return dict(model=self.model, seq=self.seq, budget=self.budget, hf=step(self.hf), tigon=step(self.tigon),
                    hf_recommendation=step(self.hf_recommendation.step) if self.hf_recommendation else None,
                    tigon_recommendation=step(self.tigon_recommendation.step) if self.tigon_recommendation else None)

    def report(self) -> str:
        lines = [f"{self.model}, sequences of {self.seq} tokens"]
        steps = [(name, s) for name, s in (("HF", self.hf), ("HF + tigon", self.tigon)) if s is not None]
        if steps:
            lines.append(f"predicted training step ({steps[0][1].optimizer}), GiB:")
            labels = ["batch", "checkpointing"] + [label for label, _ in steps[0][1].breakdown()]
            columns = [[str(s.batch), s.checkpointing] + [v for _, v in s.breakdown()] for _, s in steps]
            width = max(map(len, labels)) + 2
            col = max(14, *(len(v) + 2 for c in columns for v in c))
            lines.append(" " * width + "".join(f"{name:>{col}s}" for name, _ in steps))
            for i, label in enumerate(labels):
                lines.append(f"{label:<{width}s}" + "".join(f"{c[i]:>{col}s}" for c in columns))
            for name, s in steps:
                lines.append(f"largest single allocation, {name}: {s.largest_description()}")
        if self.budget is not None:
            lines.append(f"recommended within {self.budget / GiB:.1f} GiB usable "
                         f"({USABLE_FRACTION:.0%} of the GPU's memory):")
            for name, step, rec in (("HF", self.hf, self.hf_recommendation),
                                    ("HF + tigon", self.tigon, self.tigon_recommendation)):
                if step is not None:
                    lines.append(f"  {name:11s} {rec if rec else 'nothing fits (batch 1, every layer checkpointed)'}")
        return "\n".join(lines)


def plan(model_or_config, seq: int, *, batch: int | None = None, gpu_memory=None, optimizer: str = "adamw",
         tigon: bool = True, hf: bool = True, dtype: torch.dtype = torch.bfloat16, checkpointing=None,
         patch_options=None, progress=None) -> MemoryPlan:
    """Predict a training step's memory for HF and for HF + tigon and recommend, for each, the
    batch size (``batch`` when given) and checkpointing that maximise estimated tokens/s within
    ``gpu_memory`` (bytes or '80GiB'; default: this machine's GPU; None without one: no
    recommendation). The predicted steps are at ``batch``, else at the recommended batch, else 1."""
    config = load_config(model_or_config)
    if gpu_memory is None:
        gpu_memory = default_gpu_memory()
    budget = usable_bytes(gpu_memory) if gpu_memory is not None else None
    kw = dict(optimizer=optimizer, dtype=dtype, patch_options=patch_options)
    out = {}
    for name, on in (("hf", hf), ("tigon", tigon)):
        if not on:
            out[name] = out[name + "_rec"] = None
            continue
        rec = (recommend(config, seq, budget, tigon=name == "tigon", batch=batch, progress=progress, **kw)
               if budget else None)
        out[name + "_rec"] = rec
        if batch is None and checkpointing is None and rec is not None:
            out[name] = rec.step
        else:
            out[name] = predict_step(config, batch or 1, seq, tigon=name == "tigon", checkpointing=checkpointing, **kw)
    name = getattr(config, "_name_or_path", "") or config.model_type
    return MemoryPlan(name, seq, budget, out["hf"], out["tigon"], out["hf_rec"], out["tigon_rec"])


__all__ = ["ConfigError", "FlopModel", "MemoryPlan", "Recommendation", "StepMemory", "default_gpu_memory",
           "load_config", "plan", "predict_step", "recommend", "usable_bytes"]
