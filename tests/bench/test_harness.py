import pytest

from tigon.bench.harness import Row, fill_rates, markdown_table


def test_rates_use_gpu_time_and_measured_limits():
    row = Row("rms_norm", "16384x4096", "tigon", "bf16", full_ms=0.5, graph_ms=0.25, bytes_full=671_088_640)
    fill_rates(row, {"copy_gbps": 3000.0, "matmul_tflops": 800.0})
    assert abs(row.gbps - 671_088_640 / 0.25e-3 / 1e9) < 1e-6
    assert abs(row.frac_of_limit - row.gbps / 3000.0) < 1e-12
    mm = fill_rates(Row("mlp", "T8192", "tigon", "bf16", full_ms=10.0, flops_full=8 * 10**12), {"matmul_tflops": 800.0})
    assert abs(mm.tflops - 800.0) < 1e-9 and abs(mm.frac_of_limit - 1.0) < 1e-12


def test_markdown_table_compares_with_eager_of_the_same_case():
    rows = [
        Row("rope", "B4", "torch eager", "bf16", fwd_ms=0.6, bwd_ms=0.8, full_ms=1.4, graph_ms=1.2, peak_mb=256),
        Row("rope", "B4", "tigon", "bf16", fwd_ms=0.06, bwd_ms=0.07, full_ms=0.4, graph_ms=0.3, peak_mb=160,
            grads_mb=150),
        Row("rope", "B4", "liger", "bf16", error="RuntimeError: boom"),
        Row("rope", "B8", "tigon", "bf16", fwd_ms=0.1, bwd_ms=0.1, full_ms=0.3, peak_mb=1.0),
    ]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    tigon = lines[3].split("|")
    assert tigon[3].strip() == "tigon" and tigon[8].strip() == "4.00x"  # 1.2 / 0.3 of GPU time
    assert tigon[10].strip() == "10"  # peak beyond the returned gradients
    assert "failed: RuntimeError: boom" in lines[4]
    no_graph = lines[5].split("|")
    assert no_graph[7].strip() == "n/a" and no_graph[8].strip() == ""  # no eager row for B8


def _swept_rows():
    """Two implementations of one op at three sizes, eager at each size, one failed row."""
    rows = []
    for size in (1024, 4096, 2048):  # out of order: the sweep sorts by size
        for impl, ms in (("torch eager", 1.0 * size / 1024), ("tigon", 0.25 * size / 1024)):
            rows.append(Row("rms_norm", f"16384x{size}", impl, "bf16", fwd_ms=ms / 3, bwd_ms=ms / 2, full_ms=ms * 2,
                            graph_ms=ms, peak_mb=10.0 * size / 1024, grads_mb=2.0,
                            extra={"size_name": "hidden", "size": size}))
    rows.append(Row("rms_norm", "16384x4096", "liger", "bf16", error="RuntimeError: boom",
                    extra={"size_name": "hidden", "size": 4096}))
    rows.append(Row("rope", "B4", "tigon", "bf16", full_ms=0.5, graph_ms=0.2, peak_mb=1.0))  # no sweep
    rows.append(Row("rope", "B4", "torch eager", "bf16", full_ms=1.0, graph_ms=0.6, peak_mb=1.0))
    return rows


def test_csv_has_a_line_per_row_with_speedup_and_memory(tmp_path):
    import csv

    from tigon.bench.report import CSV_FIELDS, write_csv

    rows = _swept_rows()
    with open(write_csv(rows, tmp_path / "ops.csv")) as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == CSV_FIELDS and len(lines) == len(rows)
    tigon_4096 = next(r for r in lines if r["impl"] == "tigon" and r["size"] == "4096")
    assert float(tigon_4096["speedup_vs_eager"]) == 4.0  # GPU time 4.0 vs 1.0 ms
    assert float(tigon_4096["peak_minus_grads_mb"]) == 38.0 and tigon_4096["size_name"] == "hidden"
    failed = next(r for r in lines if r["impl"] == "liger")
    assert failed["error"] == "RuntimeError: boom" and failed["speedup_vs_eager"] == ""


def test_sweeps_group_sorted_sizes_and_skip_single_points():
    from tigon.bench.report import sweeps

    found = sweeps(_swept_rows())
    assert list(found) == ["rms_norm"]  # rope has no sizes; liger's only row failed
    axis, series = found["rms_norm"]
    assert axis == "hidden" and sorted(series) == ["tigon", "torch eager"]
    assert [size for size, _ in series["tigon"]] == [1024, 2048, 4096]


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from tigon.bench.report import plot_speedups, plot_sweeps

    rows = _swept_rows()
    paths = plot_sweeps(rows, str(tmp_path), "test GPU")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["rms_norm.png"]
    bars = plot_speedups(rows, str(tmp_path / "speedups.png"))
    for p in paths + [bars]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_results_written_and_merged(tmp_path, capsys):
    import json

    from tigon.bench.report import merge_results, write_results

    meta = {"limits": {"gpu": "Test GPU", "copy_gbps": 3000.0, "matmul_tflops": 700.0}, "torch": "t", "triton": "x",
            "liger": None, "cce": None}
    rows = _swept_rows()
    write_results([r for r in rows if r.op == "rms_norm"], meta, str(tmp_path / "a"))
    write_results([r for r in rows if r.op == "rope"], dict(meta, limits=dict(meta["limits"], copy_gbps=2900.0)),
                  str(tmp_path / "b"))
    merge_results([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "all"))
    merged = json.load(open(tmp_path / "all" / "ops.json"))
    assert len(merged["rows"]) == len(rows) and len(merged["meta"]["parts"]) == 2
    md = open(tmp_path / "all" / "ops.md").read()
    assert "3000 GB/s" in md and "2900 GB/s" in md and md.count("| rms_norm |") == 7
    assert "ops.csv" in capsys.readouterr().out


def test_merge_replaces_a_rerun_case(tmp_path):
    import json

    from tigon.bench.report import merge_results, write_results

    meta = {"limits": {"gpu": "G", "copy_gbps": 3000.0, "matmul_tflops": 700.0}, "torch": "t", "triton": "x",
            "liger": None, "cce": None}
    first = [Row("flce", "V1", "all", "bf16", error="case process exited 1: OOM"),
             Row("flce", "V2", "tigon", "bf16", full_ms=1.0, graph_ms=1.0, peak_mb=1.0)]
    again = [Row("flce", "V1", "tigon", "bf16", full_ms=2.0, graph_ms=2.0, peak_mb=1.0)]
    write_results(first, meta, str(tmp_path / "a"))
    write_results(again, meta, str(tmp_path / "b"))
    merge_results([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    rows = json.load(open(tmp_path / "m" / "ops.json"))["rows"]
    assert [(r["shape"], r["impl"], r["error"]) for r in rows] == [("V2", "tigon", None), ("V1", "tigon", None)]


def test_host_cost_rows_and_table(kernels):
    """tigon bench --host's measurement on whatever runs the kernels (the interpreter here): a row
    per op and implementation, tigon's direct path and the dispatcher's both measured."""
    from tigon.bench import host

    rows = host.measure(kernels, n=1, launches=False, warmup=0, repeats=2)
    ops = {r["op"] for r in rows}
    assert ops == {"rms_norm", "layer_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy"}
    for op in ops:
        impls = {r["impl"] for r in rows if r["op"] == op}
        assert {"tigon", "tigon via dispatcher", "torch eager"} <= impls
    assert all(r["host_us"] == min(r["rounds_us"]) > 0 and len(r["rounds_us"]) == 2 for r in rows)
    text = host.table(rows)
    assert text.splitlines()[0].startswith("| op (fwd + bwd, 16 tokens) | tigon | tigon via dispatcher |")
    assert len(text.splitlines()) == 2 + len(ops)
