"""Chunked post-training losses vs the unchunked torch version vs Liger's chunked losses:
forward+backward ms and peak memory, bf16, in one process. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/bench_losses.py [--losses dpo orpo jsd] [--impls tigon torch liger]``.

Shapes: DPO / ORPO B pairs (2B sequences) x T tokens, hidden H, vocab V (a reference model's
hidden states and head for DPO); JSD B x T tokens, student hidden H, teacher hidden H; GRPO
(``--losses grpo``) B sequences x T completion tokens, hidden H, vocab --grpo-vocab (dapo, k3 KL
to given reference log-probs, clip 0.2, old log-probs given), with ``torch+compile`` (the torch
loss under torch.compile), ``trl`` (TRL's fused LM head's log-probs, then TRL's loss math), ``3
matmuls`` (the logits, dx and dW matmuls alone: the floor) and ``3 matmuls, tokens`` (the same
over the completion tokens only: the floor of a head that skips the padding, as tigon's and
TRL's do; a quarter of the positions are padding here). Peak memory: max_memory_allocated during
one forward+backward beyond what was allocated before (inputs) and the returned gradients. Time: median of --reps
CUDA-event timings after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from tigon.losses import dpo_loss, fused_linear_jsd, grpo_loss, orpo_loss


def full_logps(x, w, target, average):
    logits = (x @ w.t()).float()
    mask = target != -100
    lp = torch.gather(logits.log_softmax(-1), -1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1) * mask
    return (lp.sum(-1) / mask.sum(-1) if average else lp.sum(-1)), lp, mask


def torch_dpo(x, w, target, ref_x, ref_w, beta=0.1):
    logps, _, _ = full_logps(x, w, target, False)
    with torch.no_grad():
        ref, _, _ = full_logps(ref_x, ref_w, target, False)
    n = x.shape[0] // 2
    return -F.logsigmoid(beta * ((logps[:n] - ref[:n]) - (logps[n:] - ref[n:]))).mean()


def torch_orpo(x, w, target, beta=0.1):
    logps, lp, mask = full_logps(x, w, target, True)
    n = x.shape[0] // 2
    c, r = logps[:n], logps[n:]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return -lp[:n].sum() / mask[:n].sum() - beta * F.logsigmoid(log_odds).mean()


def torch_jsd(sx, sw, tx, tw, target, beta=0.5):
    s = F.log_softmax((sx @ sw.t()).float(), -1)
    with torch.no_grad():
        t = F.log_softmax((tx @ tw.t()).float(), -1)
    m = torch.logsumexp(torch.stack((s + torch.log(torch.tensor(1 - beta)), t + torch.log(torch.tensor(beta)))), 0)
    jsd = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    mask = target != -100
    return (jsd * mask).sum() / mask.sum()


def torch_grpo_logps(x, w, ids):
    return torch.gather((x @ w.t()).float().log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)


def grpo_from_logps(lp, mask, adv, old, ref, beta=0.04, eps=0.2):
    """TRL's dapo loss given the policy's per-token log-probs lp [B, T] fp32."""
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    per_token = per_token + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    m = mask.float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def torch_grpo(x, w, ids, mask, adv, old, ref):
    """TRL's dapo loss over the full logits (what GRPOTrainer runs without a fused head)."""
    return grpo_from_logps(torch_grpo_logps(x, w, ids), mask, adv, old, ref)


def trl_grpo(x, w, ids, mask, adv, old, ref):
    """TRL's dapo loss on the log-probs of TRL's own fused LM head (``add_fused_lm_head``'s
    ChunkedLogProbFunction, as GRPOTrainer calls it: the completion tokens only, compacted)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    keep = mask.bool()
    lp = ChunkedLogProbFunction.apply(x[keep], w, None, ids[keep], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                      ("log_probs",))[0]
    return grpo_from_logps(lp.new_zeros(keep.shape).masked_scatter(keep, lp), mask, adv, old, ref)


def three_matmuls(x, w, g):
    """The logits, dx and dW matmuls of a linear head over all rows (the floor of a fused loss),
    then a zero loss of x so that the harness's backward has something (one [B, T, H] fill)."""
    with torch.no_grad():
        x2 = x.reshape(-1, x.shape[-1])
        x2 @ w.t()
        g @ w
        g.t() @ x2
    return x.sum() * 0


def cases(args):
    B, T, H, V = args.batch, args.seq, args.hidden, args.vocab
    dev, bf = args.device, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0, grad=False):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(bf).requires_grad_(grad)

    def tgt(n):
        t = torch.randint(0, V, (n, T), device=dev, generator=g)
        t[:, : T // 4] = -100
        return t

    out = {}
    if "dpo" in args.losses or "orpo" in args.losses:
        x, w = rnd(2 * B, T, H, grad=True), rnd(V, H, scale=H**-0.5, grad=True)
        ref_x, ref_w, pref_target = rnd(2 * B, T, H), rnd(V, H, scale=H**-0.5), tgt(2 * B)
        impls = {"tigon": lambda: dpo_loss(x, w, pref_target, ref_x=ref_x, ref_weight=ref_w)[0],
                 "torch": lambda: torch_dpo(x, w, pref_target, ref_x, ref_w)}
        liger = _liger()
        if liger:
            mod = liger.LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=True)
            impls["liger"] = lambda: mod(w, x, pref_target, None, ref_x, ref_w)[0]
        if "dpo" in args.losses:
            out[f"DPO B{B} pairs T{T} H{H} V{V}"] = (impls, [x, w])
        impls_o = {"tigon": lambda: orpo_loss(x, w, pref_target)[0], "torch": lambda: torch_orpo(x, w, pref_target)}
        if liger:
            mod_o = liger.LigerFusedLinearORPOLoss(beta=0.1)
            impls_o["liger"] = lambda: mod_o(w, x, pref_target)[0]
        if "orpo" in args.losses:
            out[f"ORPO B{B} pairs T{T} H{H} V{V}"] = (impls_o, [x, w])
    if "jsd" in args.losses:
        sx, sw = rnd(B * T, H, grad=True), rnd(V, H, scale=H**-0.5, grad=True)
        tx, tw, jsd_target = rnd(B * T, H), rnd(V, H, scale=H**-0.5), tgt(B).reshape(-1)
        impls = {"tigon": lambda: fused_linear_jsd(sx, sw, tx, tw, jsd_target)[0],
                 "torch": lambda: torch_jsd(sx, sw, tx, tw, jsd_target)}
        liger = _liger()
        if liger:
            mod_j = liger.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5)
            impls["liger"] = lambda: mod_j(sx, sw, tx, tw, jsd_target)
        out[f"JSD B{B} T{T} H{H} V{V}"] = (impls, [sx, sw])
    if "grpo" in args.losses:
        Vg = args.grpo_vocab
        gx, gw = rnd(B, T, H, grad=True), rnd(Vg, H, scale=H**-0.5, grad=True)
        ids = torch.randint(0, Vg, (B, T), device=dev, generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), device=dev, generator=g)
        mask = (torch.arange(T, device=dev) < lengths[:, None]).long()
        adv = torch.randn(B, device=dev, generator=g)
        with torch.no_grad():
            base = torch_grpo_logps(gx, gw, ids)
        old = base + 0.05 * torch.randn(B, T, device=dev, generator=g)
        ref = base + 0.05 * torch.randn(B, T, device=dev, generator=g)
        compiled = torch.compile(torch_grpo, dynamic=False)
        g_logits = torch.empty(B * T, Vg, device=dev, dtype=bf).normal_(generator=g)
        impls = {"tigon": lambda: grpo_loss(gx, gw, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old,
                                            loss_type="dapo")[0],
                 "torch": lambda: torch_grpo(gx, gw, ids, mask, adv, old, ref),
                 "torch+compile": lambda: compiled(gx, gw, ids, mask, adv, old, ref),
                 "3 matmuls": lambda: three_matmuls(gx, gw, g_logits)}
        # The floor over the completion tokens only (what a head that skips padding must do)
        keep = mask.bool()
        n_keep = int(keep.sum())
        impls["3 matmuls, tokens"] = lambda: three_matmuls(gx[keep], gw, g_logits[:n_keep])
        if _trl_available():
            impls["trl"] = lambda: trl_grpo(gx, gw, ids, mask, adv, old, ref)
        liger = _liger()
        if liger:
            mod_g = liger.LigerFusedLinearGRPOLoss(beta=0.04, use_ref_model=True, loss_type="dapo")
            impls["liger"] = lambda: mod_g(gx, gw, ids, mask, adv, ref_per_token_logps=ref,
                                           old_per_token_logps=old)[0]
        out[f"GRPO dapo B{B} T{T} H{H} V{Vg}"] = (impls, [gx, gw])
    return out



def _liger():
    try:
        import liger_kernel.chunked_loss as lc

        return lc
    except Exception:
        return None


def _trl_available():
    try:
        import trl.kernels  # noqa: F401

        return True
    except Exception:
        return False


def measure(fn, leaves, reps, on_gpu=True):
    def step():
        for t in leaves:
            t.grad = None
        loss = fn()
        (loss[0] if isinstance(loss, tuple) else loss).backward()
        return loss

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    start = time.perf_counter()
    step()  # warm-up (compiles where an implementation compiles)
    sync()
    warm_s = time.perf_counter() - start
    if not on_gpu:  # CPU smoke test: wall time, no memory figures
        start = time.perf_counter()
        loss = step()
        value = float((loss[0] if isinstance(loss, tuple) else loss).detach())
        return dict(ms=(time.perf_counter() - start) * 1e3, peak_extra_mb=float("nan"), first_call_s=warm_s,
                    loss=value)
    for t in leaves:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = step()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**20
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    value = float((loss[0] if isinstance(loss, tuple) else loss).detach())
    return dict(ms=sorted(times)[len(times) // 2], peak_extra_mb=peak, first_call_s=warm_s, loss=value)


def print_profile(fn, leaves, top=12):
    """One forward+backward of fn under torch.profiler: the GPU kernels with the most time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in leaves:
            t.grad = None
        loss = fn()
        (loss[0] if isinstance(loss, tuple) else loss).backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--losses", nargs="*", default=["dpo", "orpo", "jsd"])
    p.add_argument("--impls", nargs="*", default=["tigon", "torch", "liger", "trl", "torch+compile", "3 matmuls",
                                                    "3 matmuls, tokens"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--grpo-vocab", type=int, default=151936, help="GRPO's vocabulary (Qwen's, as the issue's shape)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", nargs="*", default=[], metavar="IMPL",
                   help="after timing, one forward+backward of these implementations under torch.profiler: "
                        "the top GPU kernels")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script with tiny shapes")
    args = p.parse_args()
    rows = []
    on_gpu = args.device == "cuda"
    print(f"{torch.cuda.get_device_name() if on_gpu else 'CPU'}, torch {torch.__version__}, bf16", flush=True)
    for name, (impls, leaves) in cases(args).items():
        for impl, fn in impls.items():
            if impl not in args.impls:
                continue
            try:
                r = measure(fn, leaves, args.reps, on_gpu)
            except Exception as exc:  # a peer failing (OOM, compile) is reported, not fatal
                r = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                if on_gpu:
                    torch.cuda.empty_cache()
            rows.append(dict(case=name, impl=impl, **r))
            if impl in args.profile and on_gpu and "ms" in r:
                print_profile(fn, leaves)
            print(f"{name:34s} {impl:17s} " + (f"{r['ms']:8.1f} ms  peak extra {r['peak_extra_mb']:8.0f} MB  "
                                               f"loss {r['loss']:.4f}  first call {r['first_call_s']:.1f} s"
                                               if "ms" in r else r["error"]), flush=True)
            if on_gpu:
                torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(dict(args=vars(args), device=torch.cuda.get_device_name() if on_gpu else "cpu", rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
