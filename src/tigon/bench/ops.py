"""The op benchmark: tigon vs torch eager vs torch.compile vs Liger-Kernel (when installed).

Run on a CUDA machine: ``python -m tigon.bench.ops [--ops rms_norm rope ...] [--out DIR]``.
Each case counts the fewest bytes (or FLOPs) forward+backward must move, so every row also
says what fraction of the measured copy bandwidth (or bf16 matmul rate) it reaches. The cases:
tigon.bench.layer_cases and tigon.bench.loss_cases (the op names and the Case record:
tigon.bench.cases; the "torch eager" formulas: tigon.reference); this module lists them and
runs them, each op's in a child process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

from tigon.bench.cases import OP_NAMES, cut_cross_entropy, liger_functional, unknown_op_error
from tigon.bench.harness import Row, measure, measure_limits
from tigon.bench.layer_cases import (
    dyt_poly_norm_cases,
    glu_cases,
    group_norm_cases,
    mlp_cases,
    moe_cases,
    norm_cases,
    relu_squared_cases,
    relu_squared_mlp_cases,
    rope_cases,
    row_activation_cases,
    tiled_mlp_cases,
)
from tigon.bench.loss_cases import cross_entropy_cases, distribution_loss_cases, flce_cases, vocab_parallel_ce_cases
from tigon.bench.report import merge_results, write_results


def all_cases(quick=False):
    liger = liger_functional()
    # Sweeps (one axis each, as the Liger paper plots them): hidden size for the norms, tokens for
    # the GLUs, sequence length for RoPE, vocabulary for the losses; --quick: one point each.
    hidden = [(16384, 4096)] if quick else [(16384, n) for n in (1024, 4096, 8192)]
    glu = [(8192, 14336)] if quick else [(t, 14336) for t in (4096, 8192, 16384)]
    rope = [(4, 32, 8, 2048, 128)] if quick else [(4, 32, 8, t, 128) for t in (1024, 4096, 8192)]
    mlp = [(8192, 4096, 14336)]
    ce = [(8192, 128256)] if quick else [(8192, v) for v in (32000, 128256, 151936)]
    flce = ([(8192, 4096, 128256)] if quick else
            [(8192, 4096, v) for v in (32000, 128256, 151936)] + [(4096, 2048, 128256)])
    cases = (norm_cases(hidden, liger) + glu_cases(glu, liger) + rope_cases(rope, liger) + mlp_cases(mlp, liger)
             + cross_entropy_cases(ce, liger, not quick)
             + flce_cases(flce, liger, cut_cross_entropy(), grad_output_variant=not quick))
    # One rank's shard of Llama 3's 128256 ids at TP 8, 2 and 1, 8192 tokens.
    vocab_shards = [(8192, 128256)] if quick else [(8192, v) for v in (16032, 64128, 128256)]
    cases += vocab_parallel_ce_cases(vocab_shards, liger)
    # GroupNorm on UNet / VAE-like activations [32, 512, S, S] in 32 groups (C / G * S^2 elements a group).
    spatial = [64] if quick else [32, 64, 128]
    cases += group_norm_cases([(32, 512, side, 32) for side in spatial], liger) + dyt_poly_norm_cases(hidden, liger)
    # softmax / sparsemax over vocabulary-like widths, 16384 rows; kl_div / tvd over BT 8192 and
    # Llama 2's and 3's vocabularies.
    widths = [(16384, 32768)] if quick else [(16384, n) for n in (4096, 16384, 32768, 128256)]
    cases += row_activation_cases(widths, liger)
    cases += distribution_loss_cases([(8192, 128256)] if quick else [(8192, v) for v in (32000, 128256)], liger)
    # ReLU² over tokens x 14336 as the GLUs; Nemotron-like MLP; a long-context SwiGLU MLP in shards.
    cases += relu_squared_cases(glu, liger) + relu_squared_mlp_cases([(8192, 4096, 16384)])
    cases += tiled_mlp_cases([(65536, 4096, 14336)] if quick else [(t, 4096, 14336) for t in (16384, 65536)], liger)
    # MoE experts: Qwen3-30B-A3B's layer (E 128, K 8, H 2048, I 768) over tokens; Mixtral-8x7B's at 8192.
    moe_tokens = [16384] if quick else [8192, 16384, 32768]
    cases += moe_cases([(t, 128, 8, 2048, 768, torch.bfloat16, True) for t in moe_tokens]
                       + ([] if quick else [(8192, 8, 2, 4096, 14336, torch.float32, False)]), liger)
    missing = set(OP_NAMES) - {case.op for case in cases}
    if missing:
        raise ValueError(f"OP_NAMES lists ops with no case: {sorted(missing)}")
    return cases, liger


def max_rel_err(a, b):
    outs_a = a if isinstance(a, (tuple, list)) else (a,)
    outs_b = b if isinstance(b, (tuple, list)) else (b,)
    errs = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)).item() for x, y in zip(outs_a, outs_b)]
    return max(errs)


def run_cases(indices, quick, limits, rows_out):
    """Measure every implementation of the cases `indices` in this process, rewriting rows_out
    (JSON) after each case, so a crash loses only the case it happened in."""
    cases, _ = all_cases(quick)
    rows = []
    for index in indices:
        rows += run_case(cases[index], quick, limits)
        with open(rows_out, "w") as f:
            json.dump([r.as_dict() for r in rows], f)
        print(f"case done: {cases[index].op} {cases[index].shape}", flush=True)  # the parent's progress bar


def run_case(case, quick, limits):
    """Measure every implementation of one case; returns its rows."""
    inputs = case.make_inputs()
    with torch.no_grad():  # no grad: nothing is computed in place over the inputs
        err = max_rel_err(case.impls["tigon"](*inputs), case.impls["torch eager"](*inputs))
    rows = []
    for name, fn in case.impls.items():
        row = Row(case.op, case.shape, name, "bf16", bytes_full=case.bytes_full, flops_full=case.flops_full)
        measure(fn, inputs, row, limits, grad_output=case.grad_output, quick=quick)
        if name == "tigon":
            row.extra["rel_err_vs_eager"] = err
        if case.size:
            row.extra["size_name"], row.extra["size"] = case.size
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {case.op} {case.shape} {name}: eager-dispatch {row.full_ms} ms, graph {row.graph_ms} ms, "
              f"peak {row.peak_mb} MB {row.error or ''}", file=sys.stderr, flush=True)
    return rows


# Liger's kl_div and tvd sync with the host in their backward too (torch.equal on grad_output).
ISOLATED_OPS = ("cross_entropy", "vocab_parallel_cross_entropy", "fused_linear_cross_entropy", "kl_div", "tvd")


def _progress_bar(total):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="case", file=sys.stderr)


def run(ops=None, quick=False, out_dir="bench_out", verbose=False, shapes=None):
    """The cases in child processes, one per op (all its sizes): a peer whose CUDA-graph capture
    fails (a host sync inside) leaks the capture's memory pool, which must not starve the other
    ops' cases. --quick runs its few cases in one child."""
    import subprocess
    import tempfile

    error = unknown_op_error(ops or ())
    if error:
        raise ValueError(f"ops: {error}")
    os.makedirs(out_dir, exist_ok=True)
    limits = measure_limits()
    cases, liger = all_cases(quick)
    selected = [i for i, c in enumerate(cases) if (not ops or c.op in ops)
                and (not shapes or any(s == c.shape or s in c.shape.split() for s in shapes))]
    # One child process per op (all its sizes), or one for the whole --quick run: the child's
    # fixed costs (imports, inductor's start-up) are paid once per group, not per case.
    groups = {}
    for index in selected:
        op = cases[index].op
        # Liger's and CCE's losses sync with the host, so their graph capture fails and leaks its
        # memory pool: a loss case (tens of GB at these shapes) gets a process of its own.
        key = "all" if quick else (op, index) if op in ISOLATED_OPS else op
        groups.setdefault(key, []).append(index)
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # small graphs: no compile-worker pool to start
    rows = []
    bar = _progress_bar(len(selected))
    for indices in groups.values():
        names = sorted({cases[i].op for i in indices})
        bar.set_description(", ".join(names) if len(names) < 3 else f"{len(indices)} cases")
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp, tempfile.TemporaryFile("w+") as err:
            cmd = [sys.executable, "-m", "tigon.bench.ops", "--case-indices", *map(str, indices),
                   "--rows-out", tmp.name, "--limits", json.dumps(limits)] + (["--quick"] if quick else [])
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if verbose else err, text=True, env=env)
            done_cases = 0
            for line in child.stdout:
                if line.startswith("case done: "):
                    done_cases += 1
                    bar.update(1)
                    bar.set_postfix_str(line[len("case done: "):].strip())
            child.wait()
            if done_cases:
                rows += [Row(**r) for r in json.load(open(tmp.name))]
            if done_cases < len(indices):
                err.seek(0)
                last = err.read().strip().splitlines()[-1:] or [""]
                rows += [Row(cases[i].op, cases[i].shape, "all", "bf16",
                             error=f"case process exited {child.returncode}: {last[0][:200]}")
                         for i in indices[done_cases:]]
                bar.update(len(indices) - done_cases)
    bar.close()
    meta = {
        "limits": limits,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "liger": getattr(__import__("liger_kernel"), "__version__", "installed") if liger else None,
        "cce": "installed" if cut_cross_entropy() else None,
    }
    write_results(rows, meta, out_dir)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="*", choices=OP_NAMES, metavar="OP",
                        help=f"op names to run (default: all): {', '.join(OP_NAMES)}")
    parser.add_argument("--quick", action="store_true", help="one size per op")
    parser.add_argument("--out", default="bench_out", help="folder for ops.json, ops.csv, ops.md and the plots")
    parser.add_argument("--verbose", action="store_true", help="show each case's own progress lines")
    parser.add_argument("--shapes", nargs="*", help="only cases with these shapes (or a word of one, e.g. V151936)")
    parser.add_argument("--merge", nargs="*", help="combine the results in these folders into --out (no GPU work)")
    parser.add_argument("--case-indices", type=int, nargs="*", help=argparse.SUPPRESS)  # internal: a child's cases
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    parser.add_argument("--limits", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case_indices is not None:
        run_cases(args.case_indices, args.quick, json.loads(args.limits), args.rows_out)
        return
    if args.merge:
        merge_results(args.merge, args.out)
        return
    run(args.ops, args.quick, args.out, args.verbose, args.shapes)


if __name__ == "__main__":
    main()
