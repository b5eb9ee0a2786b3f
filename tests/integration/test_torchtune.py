"""tigon.torchtune on a tiny torchtune Llama 3.2 decoder: the patched decoder's hidden states
through ``loss_for`` give the loss and gradients of the stock decoder's logits through cross
entropy (the recipes' label shift included), tied and untied, packed, under activation
checkpointing and under torch.compile; eval mode keeps logits."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEVICE, pick, recording_backend

pytest.importorskip("torchtune")
import tigon.torchtune as tt  # noqa: E402

VOCAB, SEQ = 160, 24
BACKEND = pick(cpu="aot_eager", gpu="inductor")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# torchtune builders: Llama 3 (RotaryPositionalEmbeddings) and Llama 3.2 (Llama3ScaledRoPE)
# rotate interleaved pairs, Qwen2 rotates halves (and has q/k/v biases), Gemma has GemmaRMSNorm
# (1 + weight), a GELU-tanh MLP and a scaled, tied embedding.


def decoder(tie=True, dtype=torch.float32, family="llama3_2"):
    from torchtune.models.gemma import gemma
    from torchtune.models.gemma2 import gemma2
    from torchtune.models.llama3 import llama3
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.models.mistral import mistral
    from torchtune.models.qwen2 import qwen2

    shape = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64,
                 intermediate_dim=96)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        if family == "llama3_2":
            model = llama3_2(**shape, tie_word_embeddings=tie)
        elif family == "qwen2":
            model = qwen2(**shape, tie_word_embeddings=tie)
        elif family == "gemma":
            assert tie, "torchtune's gemma builder ties its output"
            model = gemma(**{k: v for k, v in shape.items() if k != "num_kv_heads"}, head_dim=16, num_kv_heads=1)
        elif family == "gemma2":
            assert tie, "torchtune's gemma2 builder ties its output"
            model = gemma2(**shape, head_dim=16, sliding_window_size=8)
        elif family == "mistral":
            assert not tie, "torchtune's mistral builder has an untied output"
            model = mistral(**shape)
        else:
            assert not tie, "torchtune's llama3 builder has an untied output"
            model = llama3(**shape)
    return model.to(dtype).train()


def recipe_batch(batch=2):
    """tokens, and labels shifted as the recipes shift them (ignore_index at the end), with a
    few ignored positions inside."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    labels = tokens.clone()
    labels[0, :5] = -100
    labels = torch.hstack((labels[..., 1:], torch.full((batch, 1), -100)))
    return tokens.to(DEVICE), labels.to(DEVICE)


def reference_loss(model, tokens, labels, **kwargs):
    logits = model(tokens, **kwargs)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100)


def assert_same_gradients(ref, model, tol):
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert b.grad is not None and torch.isfinite(b.grad).all(), name
        scale = a.grad.abs().max().clamp_min(1e-6)
        assert (a.grad - b.grad).abs().max() <= tol * scale, name


def patched_pair(tie=True, dtype=torch.float32, family="llama3_2"):
    ref = decoder(tie, dtype, family)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    return ref, model, report


@pytest.mark.parametrize("family,tie", [("llama3_2", True), ("llama3_2", False), ("llama3", False), ("qwen2", True),
                                        ("gemma", True), ("mistral", False)])
def test_patched_decoder_matches_torchtune(family, tie):
    ref, model, report = patched_pair(tie, family=family)
    # One RoPE module, shared by the layers.
    expected = {"output (hidden states to the loss)": 1, "RMSNorm": 5, "RoPE": 1, "FeedForward": 2}
    assert report.patched == expected, report
    tokens, labels = recipe_batch()
    expected = reference_loss(ref, tokens, labels)
    expected.backward()
    hidden = model(tokens)
    assert hidden.shape == (2, SEQ, 64)
    loss = tt.loss_for(model)(hidden.reshape(-1, 64), labels.reshape(-1))  # as the recipe calls it
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_gradients(ref, model, tol=1e-4)
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.allclose(model(tokens), ref(tokens), rtol=1e-4, atol=1e-4)  # eval: logits


def test_gemma2_keeps_its_output_and_matches_torchtune():
    """Gemma 2 (four norms a layer, soft-capped logits): norms, RoPE and MLPs patched, the output
    left alone (the report says why): the decoder still returns logits, the stock ones, and the
    recipe's own cross entropy gives the stock gradients."""
    ref, model, report = patched_pair(family="gemma2")
    assert report.patched == {"RMSNorm": 9, "RoPE": 1, "FeedForward": 2}, report  # the final norm is wrapped
    assert any("output" in why for why in report.skipped), report
    tokens, labels = recipe_batch()
    expected = reference_loss(ref, tokens, labels)
    expected.backward()
    loss = reference_loss(model, tokens, labels)
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_gradients(ref, model, tol=1e-4)


def test_bf16_decoder_close_to_torchtune():
    ref, model, _ = patched_pair(dtype=torch.bfloat16)
    tokens, labels = recipe_batch()
    expected = reference_loss(ref, tokens, labels)
    loss = tt.loss_for(model)(model(tokens), labels)  # [b, s, d] and [b, s] work too
    assert loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) <= 2e-2 * abs(expected.item())


@pytest.mark.parametrize("family", ["llama3_2", "qwen2"])
def test_packed_batch_with_document_mask(family):
    """torchtune's packed datasets pass a block-causal mask [b, s, s] and per-document positions."""
    ref, model, _ = patched_pair(tie=family == "qwen2", family=family)
    tokens, labels = recipe_batch()
    doc = torch.arange(SEQ) >= 10  # two documents per row: 10 and SEQ - 10 tokens
    same_doc = doc[:, None] == doc[None, :]
    mask = (same_doc & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()).expand(2, SEQ, SEQ).to(DEVICE)
    input_pos = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(2, SEQ).to(DEVICE)
    expected = reference_loss(ref, tokens, labels, mask=mask, input_pos=input_pos)
    expected.backward()
    loss = tt.loss_for(model)(model(tokens, mask=mask, input_pos=input_pos), labels)
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_gradients(ref, model, tol=1e-4)


def test_activation_checkpointing():
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    ref, model, _ = patched_pair()
    for m in (ref, model):
        set_activation_checkpointing(m, auto_wrap_policy={TransformerSelfAttentionLayer})
    tokens, labels = recipe_batch()
    expected = reference_loss(ref, tokens, labels)
    expected.backward()
    loss = tt.loss_for(model)(model(tokens), labels)
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_gradients(ref, model, tol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_compiled_decoder_and_loss(checkpointing):
    """Model and loss compiled as the recipes compile them (per layer and the loss): no graph
    break from tigon, the eager stock decoder's loss and gradients."""
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    ref, model, _ = patched_pair()
    if checkpointing:
        for m in (ref, model):
            set_activation_checkpointing(m, auto_wrap_policy={TransformerSelfAttentionLayer})
    loss_fn = tt.loss_for(model)
    tokens, labels = recipe_batch()

    def step(tokens, labels):
        return loss_fn(model(tokens), labels)

    explained = torch._dynamo.explain(step)(tokens, labels)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    expected = reference_loss(ref, tokens, labels)
    expected.backward()
    loss = torch.compile(step, backend=BACKEND)(tokens, labels)
    loss.backward()
    assert torch.allclose(loss, expected, rtol=pick(cpu=1e-5, gpu=1e-4), atol=1e-6)
    assert_same_gradients(ref, model, tol=pick(cpu=1e-4, gpu=2e-3))


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "per_layer"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_compiled_mlp_keeps_only_its_input_in_checkpointed_layers(checkpointing, per_layer):
    """Under torch.compile, with torchtune's activation checkpointing the FeedForward is
    tigon::glu_mlp (keeps only x), without it tigon::glu_down, whether the whole step is
    compiled or each layer (as torchtune's recipes compile); the loss is one FLCE op."""
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    _, model, _ = patched_pair()
    if checkpointing:
        set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    ops, record = recording_backend()

    loss_fn = tt.loss_for(model)
    tokens, labels = recipe_batch()
    if per_layer:
        for layer in model.layers:
            layer.compile(backend=record)
        loss_fn.compile(backend=record)
        loss_fn(model(tokens), labels).backward()
    else:
        torch.compile(lambda t, y: loss_fn(model(t), y), backend=record)(tokens, labels).backward()
    expected, other = ("tigon.glu_mlp", "tigon.glu_down") if checkpointing else ("tigon.glu_down", "tigon.glu_mlp")
    assert any(expected in op for op in ops) and not any(other in op for op in ops), sorted(ops)
    assert any("tigon.fused_linear_cross_entropy" in op for op in ops)


@pytest.mark.parametrize("post_norm", [False, True], ids=["residual", "post_mlp_norm"])
def test_recompiled_layers_skip_the_mlp_in_checkpoints_recomputation(post_norm, monkeypatch):
    """Layers checkpointed and compiled one by one (the recipes' compile): checkpoint recomputes
    a layer's whole compiled forward, whose MLP output only the discarded layer output reads, so
    the MLP skips its matmuls there (its forward runs once a layer per step). A post-MLP norm
    (Gemma 2's mlp_scale) saves that output: then it is computed. Loss and gradients are the
    stock decoder's either way."""
    from torchtune import training
    from torchtune.modules import RMSNorm, TransformerSelfAttentionLayer

    import tigon.ops.glu_mlp as glu_mlp_module

    ref = decoder()
    if post_norm:
        for layer in ref.layers:
            layer.mlp_scale = RMSNorm(64).to(DEVICE)
            torch.nn.init.uniform_(layer.mlp_scale.scale, 0.5, 1.5)
    model = copy.deepcopy(ref)
    tt.patch(model)
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", BACKEND)  # what torchtune's compile_model reads
    for m in (ref, model):
        training.set_activation_checkpointing(m, auto_wrap_policy={TransformerSelfAttentionLayer})
    training.compile_model(model, verbose=False)
    forwards = []
    original_forward = glu_mlp_module.glu_mlp_forward
    monkeypatch.setattr(glu_mlp_module, "glu_mlp_forward",
                        lambda *a, **k: forwards.append(1) or original_forward(*a, **k))
    tokens, labels = recipe_batch()
    expected = reference_loss(ref, tokens, labels)
    expected.backward()
    loss = tt.loss_for(model)(model(tokens), labels)
    loss.backward()
    assert len(forwards) == len(model.layers) * (2 if post_norm else 1)
    assert torch.allclose(loss, expected, rtol=pick(cpu=1e-5, gpu=1e-4), atol=1e-6)
    assert_same_gradients(ref, model, tol=pick(cpu=1e-4, gpu=2e-3))


def test_unpatch_restores_logits_and_bad_calls_name_the_problem():
    ref, model, _ = patched_pair()
    tokens, labels = recipe_batch()
    with pytest.raises(ValueError, match="hidden states"):
        tt.loss_for(model)(torch.zeros(3, 64, device=DEVICE), labels)  # token counts differ
    with pytest.raises(RuntimeError, match="already patched"):
        tt.patch(model)
    with pytest.raises(TypeError, match="TransformerDecoder"):
        tt.patch(torch.nn.Linear(2, 2))
    kept_output = decoder()
    assert "output" not in str(tt.patch(kept_output, output=False))
    with pytest.raises(ValueError, match="output=True"):
        tt.loss_for(kept_output)
    tt.unpatch(model)
    with torch.no_grad():
        assert model(tokens).shape == (2, SEQ, VOCAB)  # training mode gives logits again
        assert torch.allclose(model(tokens), ref(tokens))


# ---- the recipe (tigon.torchtune_recipe) ----

class TinyTokenizer:
    """Enough of a torchtune tokenizer for the recipe on pre-tokenized data."""

    pad_id, eos_id, bos_id, max_seq_len = 0, 1, 2, SEQ


def random_token_dataset(tokenizer, n=8):
    """Pre-tokenized samples {"tokens", "labels"} of SEQ tokens, a few labels ignored."""
    g = torch.Generator().manual_seed(2)
    samples = []
    for i in range(n):
        tokens = torch.randint(3, VOCAB, (SEQ,), generator=g).tolist()
        labels = list(tokens)
        labels[: i % 4] = [-100] * (i % 4)
        samples.append({"tokens": tokens, "labels": labels})
    return samples


def recipe_config(tmp_path, compile_model):
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(
        output_dir=str(tmp_path), device="cpu" if DEVICE == "cpu" else "cuda", dtype="fp32", seed=0, shuffle=False,
        batch_size=2, epochs=1, max_steps_per_epoch=3, gradient_accumulation_steps=1, optimizer_in_bwd=False,
        resume_from_checkpoint=False, compile=compile_model, log_every_n_steps=1,
        enable_activation_checkpointing=True, enable_activation_offloading=False,
        model=dict(_component_="torchtune.models.llama3_2.llama3_2", vocab_size=VOCAB, num_layers=2, num_heads=4,
                   num_kv_heads=2, embed_dim=64, max_seq_len=64, intermediate_dim=96),
        tokenizer=dict(_component_="tests.integration.test_torchtune.TinyTokenizer"),
        dataset=dict(_component_="tests.integration.test_torchtune.random_token_dataset"),
        loss=dict(_component_="torchtune.modules.loss.CEWithChunkedOutputLoss"),
        optimizer=dict(_component_="torch.optim.AdamW", lr=1e-3),
        metric_logger=dict(_component_="torchtune.training.metric_logging.DiskLogger", log_dir=str(tmp_path)),
        profiler=dict(_component_="torchtune.training.setup_torch_profiler", enabled=False),
        checkpointer=dict(model_type="LLAMA3"),
    ))


def run_recipe(recipe_class, cfg, state):
    """Train with the recipe from ``state`` (no checkpoint files: loading and saving are
    replaced), returning the loss of every step."""
    losses = []

    class Recorded(recipe_class):
        def load_checkpoint(self, cfg_checkpointer):
            return {"model": state}

        def save_checkpoint(self, epoch):
            pass

        def _loss_step(self, batch):
            loss = super()._loss_step(batch)
            losses.append(loss.item())
            return loss

    recipe = Recorded(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()
    return losses, recipe


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_recipe_trains_like_torchtunes(tmp_path, compile_model, monkeypatch):
    """torchtune's full fine-tuning recipe with its chunked CE loss and activation
    checkpointing, and tigon's recipe on the same config: the same losses step by step."""
    from tigon.torchtune_recipe import FullFinetuneRecipeSingleDevice, TigonFullFinetuneRecipeSingleDevice

    monkeypatch.setenv("TORCH_COMPILE_BACKEND", BACKEND)  # what torchtune's compile_model reads
    state = {k: v.clone() for k, v in decoder(tie=True).state_dict().items()}
    expected, _ = run_recipe(FullFinetuneRecipeSingleDevice, recipe_config(tmp_path / "stock", compile_model), state)
    torch._dynamo.reset()
    losses, recipe = run_recipe(TigonFullFinetuneRecipeSingleDevice, recipe_config(tmp_path / "tigon", compile_model),
                                state)
    assert recipe.tigon_report.patched["FeedForward"] == 2
    assert len(losses) == len(expected) == 3
    for got, want in zip(losses, expected):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, expected)


def test_example_config_has_every_key_of_the_stock_config():
    """examples/torchtune/llama3_2_1B_full_tigon.yaml is a full config of the recipe (every key
    of torchtune's own llama3_2/1B_full_single_device, with the study's settings), and each
    component it names imports."""
    import importlib.util
    import os

    from omegaconf import OmegaConf

    recipes = list(importlib.util.find_spec("recipes").submodule_search_locations)[0]  # torchtune's recipe files
    stock = OmegaConf.load(os.path.join(recipes, "configs", "llama3_2", "1B_full_single_device.yaml"))
    example = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torchtune",
                                          "llama3_2_1B_full_tigon.yaml"))

    def keys(cfg, prefix=""):
        out = set()
        for k, v in cfg.items():
            out.add(prefix + k)
            if OmegaConf.is_dict(v):
                out |= keys(v, prefix + k + ".")
        return out

    assert keys(stock) - keys(example) == set()
    assert example.compile and example.enable_activation_checkpointing and example.dataset.packed
    assert example.tokenizer.max_seq_len == 512 and example.optimizer.fused
    for key in keys(example):
        if key.endswith("_component_"):
            module, _, name = OmegaConf.select(example, key).rpartition(".")
            assert hasattr(importlib.import_module(module), name), key
