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
