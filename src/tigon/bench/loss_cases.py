"""The op suite's cases for the losses: cross entropy (also vocab-parallel, and from a linear
head), KL divergence, total variation distance. A loss is timed with grad_output 1
(loss.backward()) unless a case says otherwise.
"""

from __future__ import annotations

import functools

import torch

from tigon import functional as TF
from tigon.bench.cases import Case, compiled, randint, randn
from tigon.reference import cross_entropy_ref, fused_linear_cross_entropy_ref, kl_div_ref, tvd_ref

# HF's loss: the logits upcast, then torch's cross entropy, its NaN for a mean over no kept row
# left alone (tigon's 0 would need a host sync, which CUDA-graph capture refuses).
EAGER_CROSS_ENTROPY = functools.partial(cross_entropy_ref, zero_when_all_ignored=False)
EAGER_LINEAR_CROSS_ENTROPY = functools.partial(fused_linear_cross_entropy_ref, zero_when_all_ignored=False)
# torch's kl_div and Liger's TVD (batchmean, no labels) on the bf16 inputs as they are.
EAGER_KL_DIV = functools.partial(kl_div_ref, upcast=False)
EAGER_TVD = functools.partial(tvd_ref, upcast=False)


def _grad_output_variants(shape, first):
    """A loss is timed with grad_output 1 (loss.backward()); the first shape also with 0.5 (a
    loss weight, or gradient accumulation), where stored gradients must be rescaled."""
    return [(shape, 1.0)] + ([(f"{shape} go=0.5", 0.5)] if first else [])


class ThreeMatmuls(torch.autograd.Function):
    """The floor of FLCE: logits = x @ w.T forward, dx = g @ w and dw = g.T @ x backward (g: the
    logits themselves, as a stand-in for their gradient). Time reference, not a loss."""

    @staticmethod
    def forward(ctx, x, w, target):
        logits = x @ w.t()
        ctx.save_for_backward(x, w, logits)
        return logits.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        x, w, g = ctx.saved_tensors
        return g @ w, g.t() @ x, None


def three_matmuls(x, w, target):
    return ThreeMatmuls.apply(x, w, target)


def cross_entropy_cases(shapes, liger, grad_output_variant=True):
    cases = []
    for i, (rows, vocab) in enumerate(shapes):
        def inputs(rows=rows, vocab=vocab):
            return [randn(rows, vocab, scale=2.0), randint(vocab, rows)]

        # tigon in place, as the patched models and Liger run it; "tigon, new gradient" is the
        # public default (the logits are left alone, as torch does).
        impls = {"tigon": functools.partial(TF.cross_entropy, inplace=True),
                 "tigon, new gradient": TF.cross_entropy, "torch eager": EAGER_CROSS_ENTROPY,
                 "torch.compile": compiled(EAGER_CROSS_ENTROPY)}
        if liger:
            impls["liger"] = liger.liger_cross_entropy
        # Read the logits once and write their gradient once.
        for shape, go in _grad_output_variants(f"{rows}x{vocab}", i == 0 and grad_output_variant):
            cases.append(Case("cross_entropy", shape, inputs, impls, bytes_full=2 * rows * vocab * 2, grad_output=go,
                              size=("vocab", vocab) if go == 1.0 else None))
    return cases


def vocab_parallel_ce_cases(shapes, liger):
    """Vocab-parallel cross entropy, single-GPU stand-in: one rank (no collective) holding a shard
    of V_r ids, swept over the shard width (V 128256 over TP 8, 2, 1). "tigon" at vocab_start 0
    is tigon's cross_entropy (what one rank runs); "tigon, sharded kernels" runs a rank's two
    passes of the several-rank path (row stats, then loss and gradient) without the all-gather of
    [N + 1, 5] fp32 stats between them. The multi-GPU benchmark (TP > 1, with the collective)
    belongs to the multi-GPU issue."""
    from tigon.ops.vocab_parallel_cross_entropy import shard_options, sharded_cross_entropy

    def sharded(logits, target):
        grad = torch.is_grad_enabled() and logits.requires_grad
        return sharded_cross_entropy(logits, target, None, 1, 0, shard_options(-100, "mean", 0.0, 0.0, None, False),
                                     grad, inplace=True)[0]

    liger_vp = None
    try:
        from liger_kernel.transformers import LigerVocabParallelCrossEntropy

        liger_vp = LigerVocabParallelCrossEntropy()  # [S, B, V] in, per-token loss out
    except Exception:
        pass
    cases = []
    for rows, vocab in shapes:
        def inputs(rows=rows, vocab=vocab):
            return [randn(rows, vocab, scale=2.0), randint(vocab, rows)]

        impls = {"tigon": functools.partial(TF.vocab_parallel_cross_entropy, vocab_start=0, inplace=True),
                 "tigon, new gradient": functools.partial(TF.vocab_parallel_cross_entropy, vocab_start=0),
                 "tigon, sharded kernels": sharded, "torch eager": EAGER_CROSS_ENTROPY,
                 "torch.compile": compiled(EAGER_CROSS_ENTROPY)}
        if liger:
            impls["liger"] = liger.liger_cross_entropy
        if liger_vp is not None:
            impls["liger, vocab-parallel"] = lambda logits, target: liger_vp(logits[:, None], target[:, None]).mean()
        # Read the logits once and write their gradient once.
        cases.append(Case("vocab_parallel_cross_entropy", f"BT{rows} V_r{vocab}", inputs, impls,
                          bytes_full=2 * rows * vocab * 2, grad_output=1.0, size=("vocab shard", vocab)))
    return cases


def flce_cases(shapes, liger, cce, sweep_hidden=4096, grad_output_variant=True):
    """The shapes with hidden == sweep_hidden (and the same rows) form the plotted vocab sweep."""
    cases = []
    for i, (rows, hidden, vocab) in enumerate(shapes):
        def inputs(rows=rows, hidden=hidden, vocab=vocab):
            return [randn(rows, hidden), randn(vocab, hidden, scale=hidden**-0.5),
                    randint(vocab, rows)]

        impls = {"tigon": TF.fused_linear_cross_entropy, "torch eager": EAGER_LINEAR_CROSS_ENTROPY,
                 "torch.compile": compiled(EAGER_LINEAR_CROSS_ENTROPY)}
        if liger:
            impls["liger"] = liger.liger_fused_linear_cross_entropy
        if cce:
            impls["cce"] = cce
        impls["3 matmuls (floor)"] = three_matmuls
        for shape, go in _grad_output_variants(f"BT{rows} H{hidden} V{vocab}", i == 0 and grad_output_variant):
            swept = hidden == sweep_hidden and rows == shapes[0][0] and go == 1.0
            cases.append(Case("fused_linear_cross_entropy", shape, inputs, impls,
                              flops_full=3 * 2 * rows * hidden * vocab, grad_output=go,
                              size=("vocab", vocab) if swept else None))
    return cases


def distribution_loss_cases(shapes, liger):
    """kl_div (input log-probabilities, target probabilities) and tvd (two probability rows),
    reduction "batchmean", only the first input requiring grad (a student against a teacher)."""
    cases = []
    for rows, vocab in shapes:
        def log_probs_and_probs(rows=rows, vocab=vocab):
            x = torch.log_softmax(randn(rows, vocab, scale=2.0, grad=False).float(), -1).to(torch.bfloat16)
            t = torch.softmax(randn(rows, vocab, scale=2.0, grad=False).float(), -1).to(torch.bfloat16)
            return [x.requires_grad_(), t]

        def two_probs(rows=rows, vocab=vocab):
            p, q = (torch.softmax(randn(rows, vocab, scale=2.0, grad=False).float(), -1).to(torch.bfloat16)
                    for _ in range(2))
            return [p.requires_grad_(), q]

        impls = {"tigon": TF.kl_div, "torch eager": EAGER_KL_DIV, "torch.compile": compiled(EAGER_KL_DIV)}
        if liger and hasattr(liger, "liger_kl_div"):
            impls["liger"] = lambda x, t: liger.liger_kl_div(x, t, reduction="batchmean")
        # Read both inputs once, write the first one's gradient once.
        cases.append(Case("kl_div", f"BT{rows} V{vocab}", log_probs_and_probs, impls, bytes_full=3 * rows * vocab * 2,
                          grad_output=1.0, size=("vocab", vocab)))
        impls = {"tigon": TF.tvd, "torch eager": EAGER_TVD, "torch.compile": compiled(EAGER_TVD)}
        if liger and hasattr(liger, "liger_tvd"):
            impls["liger"] = lambda p, q: liger.liger_tvd(p, q, None, "batchmean")
        cases.append(Case("tvd", f"BT{rows} V{vocab}", two_probs, impls, bytes_full=3 * rows * vocab * 2,
                          grad_output=1.0, size=("vocab", vocab)))
    return cases
