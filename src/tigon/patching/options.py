"""What a patch call is asked (``PatchOptions``, ``patch_options``) and what it did (``PatchReport``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tigon.ops._common import chunk_budget_bytes
from tigon.sizes import parse_bytes

_NOT_FLAGS = ("chunk_budget", "checkpointing", "memory_budget")


@dataclass(frozen=True)
class PatchOptions:
    """What a patch replaces. rope: HF's apply_rotary_pos_emb; rms_norm: every RMSNorm;
    swiglu: the MLPs' activation (gated SwiGLU / GeGLU, non-gated ReLU²) and MoE experts
    (fused grouped GEMM); fused_linear_cross_entropy: the training loss from the last hidden
    state, without the logits; cross_entropy: the loss with tigon's cross entropy over
    materialised logits (instead of FLCE); chunk_budget: bytes of logits an FLCE chunk may
    hold (None: 512 MiB); layer_norm: the LayerNorms a family row names (Nemotron's
    LayerNorm1P); checkpointing: which decoder layers activation checkpointing recomputes
    ('auto': as few as the memory planner finds fit ``memory_budget``, chosen at the first
    training forward of each batch shape; 'none', 'all' or a number of layers; None: left to
    HF), a built model only (tigon.planning.checkpointing, installed by tigon.patch);
    memory_budget: the bytes (or a string such as '70GiB') a step's allocations may reach under
    'auto' (None: 92% of the GPU's memory)."""

    rope: bool = True
    rms_norm: bool = True
    swiglu: bool = True
    fused_linear_cross_entropy: bool = True
    cross_entropy: bool = False
    chunk_budget: int | None = None
    layer_norm: bool = True
    checkpointing: str | int | None = None
    memory_budget: int | str | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in _NOT_FLAGS and not isinstance(value, bool):
                raise TypeError(f"{f.name} must be True or False, got {value!r}")
        if self.chunk_budget is not None:
            chunk_budget_bytes(self.chunk_budget)
        check_checkpointing(self.checkpointing)
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, "memory_budget")
            if self.checkpointing != "auto":
                raise ValueError("memory_budget is for checkpointing='auto' (got checkpointing="
                                 f"{self.checkpointing!r})")
        if self.fused_linear_cross_entropy and self.cross_entropy:
            raise ValueError("pass at most one of fused_linear_cross_entropy and cross_entropy "
                             "(cross_entropy=True needs fused_linear_cross_entropy=False)")

    @property
    def loss(self) -> bool:
        return self.fused_linear_cross_entropy or self.cross_entropy


PATCH_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PatchOptions))
CHECKPOINTING_CHOICES = ("auto", "none", "all")


def check_checkpointing(value) -> None:
    """Raise naming the option when ``value`` is not a checkpointing setting."""
    if value is None or value in CHECKPOINTING_CHOICES:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"checkpointing must be 'auto', 'none', 'all', a number of decoder layers or None, "
                         f"got {value!r}")


def kernels_only(opts: PatchOptions) -> PatchOptions:
    """``opts`` without the checkpointing options: what this package's patch functions take
    (``tigon.patch`` installs checkpointing after them, tigon.planning.checkpointing)."""
    return dataclasses.replace(opts, checkpointing=None, memory_budget=None)


def _refuse_checkpointing(opts: PatchOptions, caller: str) -> None:
    if opts.checkpointing is not None:
        raise ValueError(f"{caller} patches kernels only: checkpointing={opts.checkpointing!r} is installed by "
                         "tigon.patch / tigon.patch_<family> (with the memory planner)")


def patch_options(options: PatchOptions | None = None, **kwargs) -> PatchOptions:
    """A PatchOptions from an existing one and/or keyword options, with a clear error for an
    unknown name."""
    unknown = sorted(set(kwargs) - set(PATCH_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown patch option(s) {unknown}; the options are {list(PATCH_OPTION_NAMES)}")
    base = options if options is not None else PatchOptions()
    if not isinstance(base, PatchOptions):
        raise TypeError(f"options must be a tigon.PatchOptions, got {type(base).__name__}")
    return dataclasses.replace(base, **kwargs) if kwargs else base


# ---- the report ----

@dataclass
class PatchReport:
    """What a patch call replaced (piece, HF name, how many instances or 'class') and skipped."""

    family: str
    target: str
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    undo: list = field(default_factory=list, repr=False)  # (owner, name, value before), for patched()

    def pieces(self) -> set[str]:
        return {piece for piece, _, _ in self.replaced}

    def __str__(self) -> str:
        lines = [f"tigon patched {self.target} ({self.family}):"]
        if not self.replaced:
            lines.append("  nothing")
        lines += [f"  {piece:<26} {what} [{count}]" for piece, what, count in self.replaced]
        lines += [f"  {piece:<26} not patched: {why}" for piece, why in self.skipped]
        return "\n".join(lines)
