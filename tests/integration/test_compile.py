"""Patched HF models under torch.compile: no graph break from tigon, HF's loss and gradients,
one compilation for every batch size and sequence length.

On the CPU the ops run through Triton's interpreter and torch.compile uses the "aot_eager"
backend (dynamo and AOTAutograd trace the model as Inductor would see it); on the GPU, Inductor.
"""

import copy
import re

import pytest
import torch

import tigon
from tests.helpers import DEVICE, fp32_matmul_settings_kept, pick, recording_backend
from tests.integration.test_patching import SIZE, assert_same_training, batch, tiny_model

pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

BACKEND = pick(cpu="aot_eager", gpu="inductor")
# The families the compile promise is checked on (dense, tied head, soft-capped Gemma 2, MoE).
COMPILED_FAMILIES = ["llama", "qwen2", "gemma2", "mistral", "qwen3_moe"]
TIED = {"qwen2", "gemma2"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    tigon.unpatch()
    yield
    tigon.unpatch()
    torch._dynamo.reset()
    # A test that set error_on_recompile must leave it as it found it (it once leaked into the
    # next test of the process, which legitimately recompiles).
    assert not torch._dynamo.config.error_on_recompile


def patched_pair(model_type, checkpointing=False, **overrides):
    """(HF model, a patched copy with the same weights), both in training mode, with HF's
    gradient checkpointing when asked (as training scripts run them: each layer a region)."""
    ref = tiny_model(model_type, tie_word_embeddings=model_type in TIED, **overrides)
    if checkpointing:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        ref.config.use_cache = False  # else HF warns in the traced forward (a graph break of HF's)
    model = copy.deepcopy(ref)
    tigon.patch(model)
    return ref.train(), model.train()


def loss_of(model):
    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss
    return step


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("model_type", COMPILED_FAMILIES)
def test_patched_model_traces_without_graph_breaks(model_type, checkpointing):
    # HF's capture of the MoE router logits (output_router_logits) breaks the graph by itself,
    # patched or not; the rest of the model traces whole.
    overrides = dict(output_router_logits=False) if model_type == "qwen3_moe" else {}
    ref, model = patched_pair(model_type, checkpointing, **overrides)
    ids, labels = batch(model.config.vocab_size)
    hf = torch._dynamo.explain(loss_of(ref))(ids, labels)
    assert hf.graph_break_count == 0  # the test's premise: HF's own model traces whole
    torch._dynamo.reset()
    ours = torch._dynamo.explain(loss_of(model))(ids, labels)
    assert ours.graph_break_count == 0 and ours.graph_count == 1, ours


def compiled_training(model, ids, labels):
    """One forward + backward of torch.compile(model): (loss, gradients by name)."""
    compiled = torch.compile(model, backend=BACKEND)
    loss = compiled(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", COMPILED_FAMILIES)
def test_compiled_patched_model_matches_hf(model_type):
    ref, model = patched_pair(model_type, checkpointing=model_type in ("llama", "qwen2"))
    ids, labels = batch(model.config.vocab_size)
    hf_loss = ref(input_ids=ids, labels=labels).loss
    hf_loss.backward()
    hf_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    loss, grads = compiled_training(model, ids, labels)
    assert_same_training(([hf_loss.item()], hf_grads, torch.ones(1)), ([loss], grads, torch.ones(1)),
                         grad_tol=pick(cpu=1e-4, gpu=2e-3), loss_tol=pick(cpu=1e-5, gpu=1e-4))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_compiled_matches_eager_tigon(model_type):
    """Compiled and eager runs of the same patched model: the same loss and gradients."""
    _, model = patched_pair(model_type)
    twin = copy.deepcopy(model)
    ids, labels = batch(model.config.vocab_size)
    eager_loss = twin(input_ids=ids, labels=labels).loss
    eager_loss.backward()
    eager = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
    loss, grads = compiled_training(model, ids, labels)
    assert_same_training(([eager_loss.item()], eager, torch.ones(1)), ([loss], grads, torch.ones(1)),
                         grad_tol=pick(cpu=1e-5, gpu=2e-3), loss_tol=pick(cpu=1e-6, gpu=1e-4))


def test_one_compilation_for_every_batch_and_sequence_length():
    from torch._dynamo.testing import CompileCounterWithBackend

    _, model = patched_pair("llama", num_hidden_layers=1)  # one layer: the graph is a layer repeated
    counter = CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(model, backend=counter, dynamic=True)
    vocab = model.config.vocab_size
    compiled_after_first = None
    for shape in [(2, 12), (3, 9), (4, 17)]:  # sizes 0 and 1 are always specialised by torch
        ids = torch.randint(0, vocab, shape, device=DEVICE)
        compiled(input_ids=ids, labels=ids).loss.backward()
        compiled_after_first = compiled_after_first or counter.frame_count
    assert counter.frame_count == compiled_after_first, "a new batch or sequence length recompiled"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [
    "reduce-overhead",
    # Autotuning every matmul and generated kernel of a model, while 11 other test processes
    # compile, did not finish within runs of 440 and 550 s (H200, 12 workers): --exhaustive only.
    pytest.param("max-autotune-no-cudagraphs", marks=pytest.mark.exhaustive),
])
def test_compile_modes_train(mode):
    """CUDA graphs (reduce-overhead) and autotuned Inductor kernels: steps run and match eager,
    and no graph is left out of CUDA graphs ("skipping cudagraphs") where HF's own is not."""
    from torch._dynamo.utils import counters

    def skips_and_loss(model):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, mode=mode)
        for _ in range(3):  # CUDA graphs are recorded on a later step than the first
            model.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=labels).loss
            loss.backward()
        return counters["inductor"]["cudagraph_skips"], loss.item()

    ref, model = patched_pair("llama")
    twin = copy.deepcopy(model)
    ids, labels = batch(model.config.vocab_size)
    hf_skips, _ = skips_and_loss(ref)
    skips, loss = skips_and_loss(model)
    eager_loss = twin(input_ids=ids, labels=labels).loss
    assert abs(loss - eager_loss.item()) <= 1e-4 * abs(eager_loss.item())
    assert skips == hf_skips, f"{skips} graphs skipped CUDA graphs, HF's own model {hf_skips}"
    assert DEVICE == "cuda"


# The tigon ops a compiled step still calls as Python: the chunked loss, forward and backward
# (see tigon.ops.fused_linear_cross_entropy for why it is not a triton_op).
OPAQUE_UNDER_INDUCTOR = ("fused_linear_cross_entropy", "fused_linear_cross_entropy_backward")


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_inductor_launches_the_kernels_of_a_compiled_step(model_type, checkpointing):
    """In Inductor's code for a compiled training step (forward and backward) the norms, RoPE,
    the MLP and the embedding are kernels Inductor launches itself: no call of a tigon op is
    left but the loss's."""
    from torch._inductor.utils import run_and_get_code

    _, model = patched_pair(model_type, checkpointing)
    ids, labels = batch(model.config.vocab_size)
    compiled = torch.compile(model)
    _, codes = run_and_get_code(lambda: compiled(input_ids=ids, labels=labels).loss.backward())
    calls = {name for code in codes for name in re.findall(r"torch\.ops\.tigon\.(\w+)", code)}
    assert calls - set(OPAQUE_UNDER_INDUCTOR) == set(), sorted(calls)
    assert any("rms_norm" in code for code in codes)


def built_the_way(way, model_type="llama", checkpointing=False):
    """A tiny model of ``model_type`` with tigon applied as a user would (``way``): "instance"
    (tigon.patch on the built model), "class" (tigon.patch_<family>() before building, as Liger
    users do), "class after build" (the model built first: prepared at its first eager call),
    "auto" (tigon.AutoModelForCausalLM), "none" (HF's model, unpatched). HF's checkpointing on
    when asked. Class patches hold until the test's fixture unpatches."""
    size = dict(num_hidden_layers=1)  # what a layer's graph holds, the interpreter's time halved
    build = tiny_model
    if way == "class":
        getattr(tigon, f"patch_{model_type}")()
    elif way == "auto":
        def build(model_type, **overrides):
            torch.manual_seed(0)
            config = AutoConfig.for_model(model_type, **{**SIZE, **overrides})
            return tigon.AutoModelForCausalLM.from_config(config).to(DEVICE)
    model = build(model_type, **size)
    if way == "instance":
        tigon.patch(model)
    elif way == "class after build":
        getattr(tigon, f"patch_{model_type}")()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        model.config.use_cache = False
    return model.train()


WAYS = ["instance", "class", "class after build", "auto"]


@pytest.mark.parametrize("way", WAYS)
def test_patched_forward_changes_no_module_while_running_however_applied(way):
    """What torch.compile traces must not set or delete module attributes (torch 2.11 does not
    trace the dict operations that would take; a class patch that swapped the head's forward per
    call recompiled every step): after its first eager call (a class patch applied after building
    prepares the model then), a training call under HF's checkpointing sets no module attribute."""
    model = built_the_way(way, "qwen2", checkpointing=True)
    ids, labels = batch(model.config.vocab_size)
    model(input_ids=ids, labels=labels).loss.backward()
    head = model.get_output_embeddings()
    installed = vars(head).get("forward")
    seen = []
    hook = model.model.norm.register_forward_hook(lambda *_: seen.append(vars(head).get("forward")))
    model(input_ids=ids, labels=labels).loss.backward()
    hook.remove()
    assert installed is not None and seen == [installed]
    assert vars(head).get("forward") is installed


_HF_GRAPHS: dict = {}  # checkpointing -> (graphs, graph breaks) of HF's own compiled model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("way", ["class", "instance", "auto"])
def test_compiled_training_neither_breaks_nor_recompiles_however_applied(way, checkpointing, monkeypatch):
    """torch.compile(model) of a model tigon was applied to (compiled from its first call): as
    many graphs and graph breaks as HF's own model, and no recompile over three optimizer steps."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    ids, labels = batch(SIZE["vocab_size"])

    def graphs_and_breaks(model):
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            compiled(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            if step == 0:
                first = counter.frame_count
                monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # undone after the test
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", False)
        assert counter.frame_count == first
        return first, sum(counters["graph_break"].values())

    if checkpointing not in _HF_GRAPHS:  # HF's own model, once per checkpointing setting
        _HF_GRAPHS[checkpointing] = graphs_and_breaks(built_the_way("none", checkpointing=checkpointing))
    tigon.patching.mlp._ACTIVATION_OF.clear()  # the activation found anew, as in a fresh process
    assert graphs_and_breaks(built_the_way(way, checkpointing=checkpointing)) == _HF_GRAPHS[checkpointing]


@pytest.mark.parametrize("way", [pytest.param("none", marks=pytest.mark.exhaustive), "class", "instance"])
def test_trainer_with_torch_compile_does_not_recompile(way, tmp_path, monkeypatch):
    """HF's Trainer with ``torch_compile=True`` (it compiles the model) over a patched model:
    after the first step, no recompile; graph breaks as HF's own model has (none)."""
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class NoRecompileAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)

    tigon.patching.mlp._ACTIVATION_OF.clear()
    model = built_the_way(way)
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, SIZE["vocab_size"], (8, 8), generator=gen)]
    with fp32_matmul_settings_kept():  # TrainingArguments(torch_compile=True) turns TF32 on for the process
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                 learning_rate=1e-3, torch_compile=True, torch_compile_backend=BACKEND, report_to=[],
                                 save_strategy="no", use_cpu=DEVICE != "cuda", logging_steps=1)
        counters.clear()
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[NoRecompileAfterFirstStep()])
        trainer.train()
    assert trainer.state.global_step == 3
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_compiled_mlp_keeps_only_its_input_in_checkpointed_layers(checkpointing):
    """Under torch.compile, a checkpointed layer's gated MLP is tigon::glu_mlp (keeps only x;
    the region's recomputation would form gate and up again anyway), as in eager; without
    checkpointing it is tigon::glu_down (keeps gate and up, no recomputation)."""
    _, model = patched_pair("llama", checkpointing)
    ops, record = recording_backend()

    ids, labels = batch(model.config.vocab_size)
    torch.compile(model, backend=record)(input_ids=ids, labels=labels).loss.backward()
    expected, other = ("tigon.glu_mlp", "tigon.glu_down") if checkpointing else ("tigon.glu_down", "tigon.glu_mlp")
    assert any(expected in op for op in ops) and not any(other in op for op in ops), sorted(ops)


def test_compiled_loss_queues_its_label_check():
    """The patched loss's label range check is queued instead of syncing the host (CUDA), also
    in a compiled graph, where it is the op's argument (no flag is read at run time)."""
    _, model = patched_pair("llama")
    calls = []

    def record(gm, example_inputs):
        calls.extend(n for n in gm.graph.nodes
                     if n.op == "call_function" and "fused_linear_cross_entropy" in str(n.target))
        return gm.forward

    ids, labels = batch(model.config.vocab_size)
    torch.compile(model, backend=record)(input_ids=ids, labels=labels).loss.backward()
    schema = torch.ops.tigon.fused_linear_cross_entropy.default._schema
    position = [a.name for a in schema.arguments].index("defer_label_check")
    assert calls and all(n.args[position] is True for n in calls)


def sdpa_masks(model, ids, labels):
    """Whether each SDPA call of the compiled model's traced graph got an explicit mask."""
    masked = []

    def record(gm, example_inputs):
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                masked.extend(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) is not None
                              for n in sub.graph.nodes
                              if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=record)(input_ids=ids, labels=labels).loss.backward()
    return masked


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_compiled_attention_is_causal_without_a_mask(model_type, monkeypatch):
    """Without attention mask, positions or cache, eager HF runs SDPA with is_causal=True; traced,
    HF (transformers < 5.2x, or torch < 2.14) materialises the [B, 1, T, T] mask, which the
    stand-in below reproduces on any version. A patched model keeps is_causal under compile; a
    given attention mask is still applied."""
    from transformers import masking_utils

    hf_rule = masking_utils._ignore_causal_mask_sdpa

    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return not torch.compiler.is_compiling() and hf_rule(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                             local_attention_size)

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", _ignore_causal_mask_sdpa)
    ref = tiny_model(model_type).train()
    model = copy.deepcopy(ref)
    assert "causal_mask" in tigon.patch(model).pieces()
    ids, labels = batch(model.config.vocab_size)
    hf = sdpa_masks(ref, ids, labels)
    assert hf and all(hf)  # the premise: traced HF passes a mask
    ours = sdpa_masks(model, ids, labels)
    assert len(ours) == len(hf) and not any(ours)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend()[1])
    loss = compiled(input_ids=ids, labels=labels, attention_mask=padded).loss
    eager = ref(input_ids=ids, labels=labels, attention_mask=padded).loss
    assert torch.allclose(loss, eager, rtol=pick(cpu=1e-5, gpu=1e-3)), (loss, eager)
