"""The memory planner (tigon.planning: prediction, memory_trace, planner) and
tigon.patch(checkpointing=...): the meta-device trace's arithmetic, the trace against a real
step's allocations (CPU, tigon's kernels in the interpreter), the recommendation, the
checkpointing policy, ``tigon plan``."""

import json

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tigon.hf_model import decoder_layers, set_checkpointing
from tigon.planning import memory_trace, plan, predict_step, recommend
from tigon.planning.memory_trace import AllocationTracker, allocated_bytes, planning_attention_installed
from tigon.sizes import GiB, parse_bytes

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
            vocab_size=1000)
CONFIGS = {
    "llama_tied": ("llama", dict(TINY, tie_word_embeddings=True)),
    "llama_untied": ("llama", dict(TINY, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(TINY, tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(TINY, head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", dict(TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, tie_word_embeddings=False)),
}


def config(name):
    model_type, kwargs = CONFIGS[name]
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def test_tracker_counts_each_storage_once_while_it_lives():
    tracker = AllocationTracker()
    with tracker:
        a = torch.empty(1000, 3, device="meta")  # 12000 bytes, rounded to 12288
        view = a[1:].t()
        a.mul_(2)  # in place: the same storage
        assert tracker.current == allocated_bytes(12000) == 12288
        b = torch.empty(10, dtype=torch.bfloat16, device="meta")
        assert tracker.current == 12288 + 512
        del a
        assert tracker.current == 12288 + 512  # the view keeps the storage alive
        del view
        assert tracker.current == 512
        del b
    assert tracker.current == 0
    assert tracker.trace.peak == 12288 + 512


def test_planning_attention_keeps_no_attention_matrix():
    """What the fused GPU kernels keep (q, k, v, out, the fp32 log-sum-exp), not [T, T]."""
    q = torch.empty(2, 4, 512, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(2, 4, 512, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(2, 4, 512, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    tracker = AllocationTracker()
    with planning_attention_installed(), tracker:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.nn.functional.scaled_dot_product_attention is not memory_trace.planning_attention
    assert out.shape == q.shape
    assert tracker.current == q.nbytes + 2 * 4 * 512 * 4  # the output and the log-sum-exp


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_predicted_step_arithmetic(name):
    """Parameters (tied weights once), gradients, optimizer state by optimizer, a peak above
    the static memory, activations growing with the batch, checkpointing keeping less."""
    cfg = config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    s1 = predict_step(cfg, 1, 64, tigon=False)
    assert s1.parameters == s1.gradients == 2 * n_params
    assert s1.optimizer_state == pytest.approx(2 * s1.parameters, rel=0.05)  # blocks rounded to 512 bytes
    assert s1.peak > s1.parameters + s1.gradients + s1.optimizer_state - s1.gradients  # grads live by the backward
    assert s1.n_layers == cfg.num_hidden_layers
    assert predict_step(cfg, 1, 64, tigon=False, optimizer="sgd").optimizer_state == 0
    assert 0.5 * s1.parameters < predict_step(cfg, 1, 64, tigon=False, optimizer="adamw8bit").optimizer_state \
        < 1.2 * s1.parameters
    s2, s4 = predict_step(cfg, 2, 64, tigon=False), predict_step(cfg, 4, 64, tigon=False)
    assert s1.activations < s2.activations < s4.activations
    assert s4.activations - s2.activations == pytest.approx(2 * (s2.activations - s1.activations), rel=0.05)
    every = predict_step(cfg, 4, 64, tigon=False, checkpointing="all")
    assert every.checkpointed_layers == cfg.num_hidden_layers and every.activations < s4.activations
    half = predict_step(cfg, 4, 64, tigon=False, checkpointing=2)
    assert every.activations < half.activations < s4.activations
    tied = getattr(cfg, "tie_word_embeddings", False)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied


@pytest.mark.parametrize("name", ["llama_tied", "qwen2", "gemma2", "qwen3_moe"])
def test_tigon_keeps_no_logits(name):
    """With tigon the [batch, seq, vocab] logits are never allocated: its largest allocation
    and peak sit below HF's at a vocabulary this much wider than the hidden size."""
    cfg = config(name)
    hf, tg = predict_step(cfg, 4, 128, tigon=False), predict_step(cfg, 4, 128, tigon=True)
    logits = 4 * 128 * cfg.vocab_size * 4
    assert hf.largest.bytes >= logits and tg.largest.bytes < logits
    assert tg.peak < hf.peak


def _real_cpu_step(cfg, use_tigon, batch, seq):
    """Peak bytes a real CPU step (tigon's kernels in the interpreter) allocates, counted by the
    same tracker: parameters and optimizer state included, attention as the planner counts it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if use_tigon:
        tigon.patch(model)
    model.train()
    tracker = AllocationTracker(keep_timeline=False)
    for p in model.parameters():
        tracker.track(p)
    for b in model.buffers():
        tracker.track(b)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    try:
        with planning_attention_installed(), tracker:
            state = [torch.zeros_like(p) for p in model.parameters() for _ in range(2)]
            x = ids.clone()
            model(input_ids=x, labels=x).loss.backward()
    finally:
        tigon.unpatch()
    del state
    return tracker.trace.peak


@pytest.mark.skipif(DEVICE != "cpu", reason="compares against a real step on the CPU under the interpreter")
@pytest.mark.parametrize("use_tigon", [False, True], ids=["hf", "tigon"])
def test_meta_trace_matches_a_real_step(use_tigon):
    """The meta-device prediction against the same step run for real (CPU tensors, tigon's ops
    running their kernels in the interpreter): the bodies that allocate are the same code."""
    cfg = config("llama_untied")
    predicted = predict_step(cfg, 2, 48, tigon=use_tigon, dtype=torch.float32)
    real = _real_cpu_step(cfg, use_tigon, 2, 48)
    assert predicted.peak == pytest.approx(real, rel=0.02)


def test_recommend_checkpoints_the_fewest_layers_that_fit():
    cfg = config("llama_untied")
    none = predict_step(cfg, 8, 128, checkpointing="none")
    every = predict_step(cfg, 8, 128, checkpointing="all")
    assert every.required < none.required
    roomy = recommend(cfg, 128, none.required + 1, batch=8)
    assert roomy.step.checkpointed_layers == 0
    middle = recommend(cfg, 128, (none.required + every.required) // 2, batch=8)
    assert 0 < middle.step.checkpointed_layers < cfg.num_hidden_layers
    assert middle.step.required <= (none.required + every.required) // 2
    assert predict_step(cfg, 8, 128, checkpointing=middle.step.checkpointed_layers - 1).required > \
        (none.required + every.required) // 2
    assert recommend(cfg, 128, every.required - 1, batch=8) is None


def test_recommend_finds_the_largest_batch_within_the_budget():
    cfg = config("llama_untied")
    budget = predict_step(cfg, 12, 64, checkpointing="none").required
    rec = recommend(cfg, 64, budget, max_batch=64)
    assert rec.step.required <= budget
    assert rec.step.batch >= 12  # no checkpointing fits 12; checkpointing may fit more
    assert recommend(cfg, 64, predict_step(cfg, 1, 64, checkpointing="all").required - 1) is None


def test_plan_reports_both_and_serialises():
    cfg = config("qwen2")
    result = plan(cfg, 64, batch=4, gpu_memory="1GiB")
    assert result.hf.batch == result.tigon.batch == 4
    text = result.report()
    assert "HF + tigon" in text and "peak" in text and "recommended within" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["tigon"]["peak"] == result.tigon.peak and data["hf"]["peak"] == result.hf.peak
    assert plan(cfg, 64, batch=4, gpu_memory="1GiB", hf=False).hf is None


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * GiB), ("80 GB", 80 * 10**9), ("1.5MiB", 1572864),
                                            ("4096", 4096), (2048, 2048)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-3GiB", "0", True, [80]])
def test_parse_bytes_rejects_naming_the_argument(bad):
    with pytest.raises((TypeError, ValueError), match="gpu_memory"):
        parse_bytes(bad, "gpu_memory")


def test_moe_experts_are_planned_on_tigons_op():
    """tigon's fused experts run in the planning trace (they leave meta weights to HF's
    forward outside it): the prediction differs from tigon without its experts patch."""
    from tigon.patching import PatchOptions

    cfg = config("qwen3_moe")
    fused = predict_step(cfg, 4, 64, tigon=True)
    unfused = predict_step(cfg, 4, 64, tigon=True, patch_options=PatchOptions(swiglu=False))
    assert fused.peak != unfused.peak


def test_predict_step_rejects_bad_arguments():
    cfg = config("qwen2")
    vision = transformers.AutoConfig.for_model("qwen2_5_vl")
    with pytest.raises(ValueError, match="causal language models"):
        predict_step(vision, 1, 64)
    with pytest.raises(ValueError, match="batch"):
        predict_step(cfg, 0, 64)
    with pytest.raises(ValueError, match="optimizer"):
        predict_step(cfg, 1, 64, optimizer="adam")
    with pytest.raises(ValueError, match="checkpointing"):
        predict_step(cfg, 1, 64, checkpointing="some")


def _tiny_model():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("llama_untied"), dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU model under the interpreter")
def test_patch_checkpointing_auto_picks_layers_and_keeps_the_gradients(kernels):
    """Under a budget between no checkpointing and every layer, 'auto' checkpoints some layers,
    applies them again after HF's gradient_checkpointing_enable (HF Trainer's path), and the
    loss and gradients equal those without checkpointing; unpatch restores the forward."""
    cfg = config("llama_untied")
    none = predict_step(cfg, 2, 32, checkpointing="none", dtype=torch.float32)
    every = predict_step(cfg, 2, 32, checkpointing="all", dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))

    reference = _tiny_model()
    tigon.patch(reference)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    tigon.unpatch()

    model = _tiny_model()
    signature = str(__import__("inspect").signature(model.forward))
    report = tigon.patch(model, checkpointing="auto", memory_budget=(none.required + every.required) // 2)
    assert "checkpointing" in str(report) and str(__import__("inspect").signature(model.forward)) == signature
    try:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        flags = [layer.gradient_checkpointing for layer in decoder_layers(model)]
        assert 0 < sum(flags) < len(flags)
        model.gradient_checkpointing_enable()
        assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == flags
    finally:
        tigon.unpatch()
    assert "forward" not in vars(model)
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_patch_checkpointing_fixed_counts():
    model = _tiny_model()
    with pytest.raises(ValueError, match="checkpointing"):
        tigon.patch(model, checkpointing="sometimes")
    with pytest.raises(ValueError, match="memory_budget"):
        tigon.patch(model, checkpointing="all", memory_budget="10GiB")
    with pytest.raises(ValueError, match="memory_budget"):
        tigon.patch(model, checkpointing="auto", memory_budget="lots")
    with pytest.raises(ValueError, match="built model"):
        tigon.patch_llama(None, checkpointing="auto")
    assert set_checkpointing(model, 2) == [0, 2]
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False, True, False]
    assert set_checkpointing(model, 0) == []


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU model under the interpreter")
def test_family_patcher_installs_checkpointing_and_the_kernel_patch_refuses_it(kernels):
    """tigon.patch_<family>(model, checkpointing=...) composes the kernel patch with checkpointing;
    tigon.patching's own patch functions patch kernels only and say where the option belongs."""
    model = _tiny_model()
    with pytest.raises(ValueError, match="tigon.patch / tigon.patch_<family>"):
        tigon.patching.patch(model, checkpointing="all")
    with pytest.raises(ValueError, match="tigon.patch / tigon.patch_<family>"):
        tigon.patching.patch_llama(model, checkpointing=2)
    assert "forward" not in vars(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    try:
        report = tigon.patch_llama(model, checkpointing=2)
        assert "2 decoder layers" in str(report)
        model(input_ids=ids, labels=ids).loss.backward()
        assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False, True, False]
    finally:
        tigon.unpatch()
    assert "forward" not in vars(model)


def test_cli_plan_on_a_config_file(tmp_path, capsys):
    from tigon.cli import main

    config("llama_tied").save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(tmp_path / "config.json"), "--seq", "64", "--batch", "2", "--gpu-memory", "1GiB",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "HF + tigon" in text and "recommended within 0.9 GiB" in text
    assert json.loads(out.read_text())["tigon"]["batch"] == 2
    with pytest.raises(SystemExit) as done:
        main(["plan", str(tmp_path), "--seq", "64", "--gpu-memory", "plenty"])
    assert done.value.code == 2 and "--gpu-memory" in capsys.readouterr().err


def test_cli_memory_timeline_without_a_gpu_says_so(capsys):
    from tigon.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the timeline would run")
    assert main(["bench", "--memory-timeline"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_every_op_registers_its_body_for_the_planner():
    """A planning trace runs each tigon op's Python body (OP_BODIES): ops register through
    tigon.ops._common's custom_op / kernel_op, never torch.library directly."""
    from pathlib import Path

    from tigon.ops._common import OP_BODIES

    ops_dir = Path(tigon.ops.__file__).parent
    for path in ops_dir.glob("*.py"):
        if path.name != "_common.py":
            text = path.read_text()
            assert "torch.library.custom_op(" not in text and "torch.library.triton_op(" not in text, path.name
    assert {"tigon::fused_linear_cross_entropy", "tigon::rms_norm", "tigon::glu_mlp"} <= set(OP_BODIES)
