"""What a benchmark run writes besides ops.json and ops.md: a CSV of every row and PNG plots.

Plots (matplotlib, when installed): for each op swept over a size, GPU time and peak memory
against the size, one line per implementation (``<op>.png``); and one bar chart of every
implementation's speed-up over torch eager at each op's largest swept size (``speedups.png``).
"""

from __future__ import annotations

import csv
import json
import os

from tigon.bench.harness import Row, gpu_ms, markdown_table, speedups

CSV_FIELDS = ["op", "shape", "impl", "dtype", "size_name", "size", "fwd_ms", "bwd_ms", "full_ms", "graph_ms",
              "gpu_ms", "peak_mb", "grads_mb", "peak_minus_grads_mb", "gbps", "tflops", "frac_of_limit",
              "speedup_vs_eager", "error", "extra"]
# Fixed colours and markers, so an implementation looks the same in every plot.
STYLE = {"tigon": ("#d62728", "o"), "torch eager": ("#7f7f7f", "s"), "torch.compile": ("#1f77b4", "^"),
         "liger": ("#2ca02c", "D"), "cce": ("#9467bd", "v"), "3 matmuls (floor)": ("#000000", "")}


def write_csv(rows: list[Row], path: str) -> str:
    ratio = speedups(rows)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            extra = dict(r.extra)
            size_name, size = extra.pop("size_name", None), extra.pop("size", None)
            peak_extra = r.peak_mb - r.grads_mb if r.peak_mb is not None and r.grads_mb is not None else None
            writer.writerow(dict(op=r.op, shape=r.shape, impl=r.impl, dtype=r.dtype, size_name=size_name, size=size,
                                 fwd_ms=r.fwd_ms, bwd_ms=r.bwd_ms, full_ms=r.full_ms, graph_ms=r.graph_ms,
                                 gpu_ms=gpu_ms(r), peak_mb=r.peak_mb, grads_mb=r.grads_mb,
                                 peak_minus_grads_mb=peak_extra, gbps=r.gbps, tflops=r.tflops,
                                 frac_of_limit=r.frac_of_limit, speedup_vs_eager=ratio.get((r.op, r.shape, r.impl)),
                                 error=r.error, extra=json.dumps(extra) if extra else ""))
    return path


def sweeps(rows: list[Row]) -> dict:
    """op -> (axis name, {impl: sorted [(size, row)]}) for ops measured at two sizes or more."""
    out = {}
    for r in rows:
        if r.error or "size" not in r.extra:
            continue
        name, series = out.setdefault(r.op, (r.extra["size_name"], {}))
        series.setdefault(r.impl, []).append((r.extra["size"], r))
    for op in list(out):
        name, series = out[op]
        for impl in series:
            series[impl].sort(key=lambda p: p[0])
        if max(len(v) for v in series.values()) < 2:
            del out[op]
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def plot_sweeps(rows: list[Row], out_dir: str, title_suffix: str = "") -> list[str]:
    """One PNG per swept op: GPU ms and peak memory beyond the returned gradients vs size."""
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    for op, (axis, series) in sweeps(rows).items():
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        for impl, points in series.items():
            colour, marker = STYLE.get(impl, (None, "x"))
            xs = [p[0] for p in points]
            ax_t.plot(xs, [gpu_ms(p[1]) for p in points], marker=marker, color=colour, label=impl,
                      linestyle=":" if impl.endswith("(floor)") else "-")
            mem = [(x, p.peak_mb - (p.grads_mb or 0)) for x, p in points if p.peak_mb is not None]
            if mem and not impl.endswith("(floor)"):
                ax_m.plot([m[0] for m in mem], [m[1] for m in mem], marker=marker, color=colour, label=impl)
        ax_t.set_title(f"{op}: forward + backward time", fontsize=11)
        ax_t.set_ylabel("GPU ms (lower is better)")
        ax_m.set_title(f"{op}: peak memory, gradients excluded", fontsize=11)
        ax_m.set_ylabel("MB (lower is better)")
        for ax in (ax_t, ax_m):
            ax.set_xlabel(axis)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        if title_suffix:
            fig.suptitle(title_suffix, fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{op}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_speedups(rows: list[Row], path: str, title_suffix: str = "") -> str | None:
    """Speed-up over torch eager (GPU time) of every implementation, at each op's largest
    swept size (or its only case), one group of bars per op."""
    plt = _pyplot()
    if plt is None:
        return None
    ratio = speedups(rows)
    chosen = {}  # op -> shape: the largest swept size, else the first case
    for r in rows:
        if r.error or "go=" in r.shape:
            continue
        size = r.extra.get("size", -1)
        if r.op not in chosen or size > chosen[r.op][0]:
            chosen[r.op] = (size, r.shape)
    impls = [i for i in STYLE if i not in ("torch eager", "3 matmuls (floor)") and
             any(k[2] == i for k in ratio)]
    ops = list(chosen)
    if not ops or not impls:
        return None
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(ops)), 4))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        values = [ratio.get((op, chosen[op][1], impl), 0.0) for op in ops]
        ax.bar([i + (j - (len(impls) - 1) / 2) * width for i in range(len(ops))], values, width,
               label=impl, color=STYLE[impl][0])
    ax.axhline(1.0, color="#7f7f7f", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels([f"{op}\n{chosen[op][1]}" for op in ops], fontsize=7, rotation=15, ha="right")
    ax.set_ylabel("speed-up over torch eager (fwd + bwd)")
    ax.set_title("Speed-up over torch eager" + (f" ({title_suffix})" if title_suffix else ""), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def header_line(meta: dict) -> str:
    limits = meta["limits"]
    return (f"GPU {limits['gpu']}: copy {limits['copy_gbps']:.0f} GB/s, bf16 matmul "
            f"{limits['matmul_tflops']:.0f} TFLOP/s; torch {meta['torch']}, triton {meta['triton']}, "
            f"liger {meta['liger']}, cce {meta['cce']}")


def write_results(rows: list[Row], meta: dict, out_dir: str) -> list[str]:
    """ops.json, ops.csv, ops.md and the plots; prints the table. Returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ops.json"), "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=1)
    header = header_line(meta)
    parts = meta.get("parts")
    if parts:  # merged runs: each measured its own ceilings (its fractions use them)
        header += "\n\nMerged from runs with ceilings: " + "; ".join(
            f"{p['limits']['copy_gbps']:.0f} GB/s, {p['limits']['matmul_tflops']:.0f} TFLOP/s" for p in parts)
    table = markdown_table(rows)
    with open(os.path.join(out_dir, "ops.md"), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    files = [os.path.join(out_dir, n) for n in ("ops.json", "ops.md")]
    files.append(write_csv(rows, os.path.join(out_dir, "ops.csv")))
    where = f"{meta['limits']['gpu']}, torch {meta['torch']}, triton {meta['triton']}, bf16"
    files += plot_sweeps(rows, out_dir, where)
    bars = plot_speedups(rows, os.path.join(out_dir, "speedups.png"), where)
    files += [bars] if bars else []
    print(header)
    print(table)
    print("wrote " + ", ".join(os.path.basename(p) for p in files) + f" in {out_dir}" +
          ("" if bars else " (install matplotlib for the plots)"))
    return files


def merge_results(dirs: list[str], out_dir: str) -> list[str]:
    """One result set from several runs' folders (e.g. a suite run in parts). A case (op, shape)
    measured in a later folder replaces the same case from earlier ones (a re-run)."""
    rows, metas = [], []
    for d in dirs:
        with open(os.path.join(d, "ops.json")) as f:
            data = json.load(f)
        new = [Row(**r) for r in data["rows"]]
        redone = {(r.op, r.shape) for r in new}
        rows = [r for r in rows if (r.op, r.shape) not in redone] + new
        metas.append(data["meta"])
    meta = dict(metas[0], parts=metas) if len(metas) > 1 else metas[0]
    return write_results(rows, meta, out_dir)
