"""What a patch touches and what it leaves alone: instance patches change one model only, options
are checked, copies and pickles of a patched model behave as documented, unpatch leaves nothing
behind, and models tigon does not know are left working."""

import copy
import gc
import io
import weakref

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tests.integration.test_patching import batch, rel, tiny_model
from tigon.patching import FAMILIES, PatchOptions, rope

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _unpatched_after():
    tigon.unpatch()
    yield
    tigon.unpatch()


@pytest.fixture
def rope_calls(monkeypatch):
    """Calls of tigon's RoPE, through the module-level dispatcher."""
    calls = []
    ours = rope.tigon_apply_rotary_pos_emb
    monkeypatch.setattr(rope, "tigon_apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or ours(*a, **k))
    return calls


def tigon_entries(model):
    """(module name, attribute) of everything tigon put on the modules of ``model``."""
    return [(name, attr) for name, m in model.named_modules() for attr, value in vars(m).items()
            if "tigon" in attr or "tigon" in type(value).__module__ or hasattr(value, "_tigon")]


def test_instance_patch_changes_that_model_only(rope_calls, monkeypatch):
    from transformers import masking_utils

    checks = []
    original_check = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: checks.append(1) or original_check(p))
    patched, other = tiny_model("llama"), tiny_model("llama")
    ids, labels = batch(other.config.vocab_size)
    with torch.no_grad():
        expected = other(input_ids=ids).logits.clone()
    tigon.patch(patched)
    with torch.no_grad():
        patched(input_ids=ids)
        assert rope_calls, "the patched model runs tigon's RoPE"
        rope_calls.clear()
        checks.clear()
        assert torch.equal(other(input_ids=ids).logits, expected)  # HF's forwards, bit for bit
    assert rope_calls == []
    assert tigon_entries(other) == []
    other.train()
    other(input_ids=ids, labels=labels, use_cache=False).loss.backward()  # with a cache HF does not check
    assert checks, "an unpatched model keeps HF's packed-sequence check"
    from transformers.models.llama import modeling_llama

    assert getattr(modeling_llama.apply_rotary_pos_emb, "_tigon_original", None) is not None
    tigon.unpatch()
    assert not hasattr(modeling_llama.apply_rotary_pos_emb, "_tigon")


def test_class_patch_stays_global(rope_calls):
    tigon.patch_llama()
    model = tiny_model("llama")
    ids, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=ids)
    assert rope_calls == []  # the module function is tigon's own, not the dispatcher
    from transformers.models.llama import modeling_llama

    assert modeling_llama.apply_rotary_pos_emb._tigon == "rope"


def test_family_patcher_takes_the_model_first_and_options_by_keyword():
    model = tiny_model("llama")
    report = tigon.patch_llama(model, rope=False)
    assert report.target == "LlamaForCausalLM" and "rope" not in report.pieces()
    from transformers.models.llama import modeling_llama

    assert not hasattr(modeling_llama.LlamaRMSNorm.forward, "_tigon")  # the classes are untouched
    with pytest.raises(TypeError, match="patch_llama's first argument is the model"):
        tigon.patch_llama(False)
    with pytest.raises(TypeError, match="options must be a tigon.PatchOptions"):
        tigon.patch_llama(model, True)
    assert tigon.patch_llama(model, PatchOptions(swiglu=False)).pieces() >= {"rms_norm", "rope"}
    assert set(FAMILIES) == {name.removeprefix("patch_") for name in tigon.patching.PATCHERS}
    for name in FAMILIES:  # each defined by name in tigon.patching (greppable), and exported
        assert getattr(tigon, f"patch_{name}").__name__ == f"patch_{name}"


def test_bad_options_and_targets_are_clear_errors():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="chunk_budget must be a positive number of bytes"):
        tigon.patch(model, chunk_budget=0)
    with pytest.raises(TypeError, match=r"unknown patch option\(s\) \['swigl'\]"):
        tigon.patch(model, swigl=False)
    with pytest.raises(TypeError, match="rope must be True or False"):
        tigon.patch(model, rope="no")
    with pytest.raises(ValueError, match="at most one of fused_linear_cross_entropy and cross_entropy"):
        tigon.patch(model, cross_entropy=True)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        tigon.patch("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match=r"unknown family 'foo'; tigon knows \[.*'llama'"):
        with tigon.patched(family="foo"):
            pass
    assert tigon_entries(model) == []  # nothing was changed by the refused calls
    with pytest.warns(UserWarning, match="tigon.patch found nothing to patch in Linear"):
        report = tigon.patch(torch.nn.Linear(3, 3))
    assert "nothing" in str(report)


def test_deep_copy_is_patched_and_unpatch_reaches_it():
    model = tiny_model("llama")
    tigon.patch(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.model.norm.weight.mul_(2.0)  # the copy's forward must use the copy's weight
    x = torch.randn(3, model.config.hidden_size, device=DEVICE)
    with torch.no_grad():
        assert rel(clone.model.norm(x), 2 * model.model.norm(x)) < 1e-6
    assert "forward" in vars(clone.model.norm) and tigon_entries(clone)
    tigon.unpatch()
    assert tigon_entries(clone) == [] and tigon_entries(model) == []


def test_unpatch_of_one_model_and_no_leftovers():
    a, b = tiny_model("llama"), tiny_model("llama")
    ids, labels = batch(a.config.vocab_size)
    tigon.patch(a)
    tigon.patch(b)
    a.train()
    a(input_ids=ids, labels=labels).loss.backward()  # runs every forward (the MLP finds its activation)
    assert tigon.unpatch(a) > 0
    assert tigon_entries(a) == [] and tigon_entries(b)
    tigon.unpatch()
    assert tigon_entries(b) == []


def test_pickled_patched_model_loads_unpatched_and_says_so():
    model = tiny_model("llama")
    ids, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    tigon.patch(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with pytest.warns(UserWarning, match="pickled while patched by tigon and loads unpatched"):
        loaded = torch.load(buffer, weights_only=False)
    assert tigon_entries(loaded) == []
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)
    assert tigon.patch(loaded).pieces() >= {"rms_norm", "rope", "swiglu"}  # and it can be patched again


def test_a_patched_model_can_be_freed():
    model = tiny_model("llama")
    tigon.patch(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_accelerate_hooks_keep_running():
    """accelerate's hooks (device_map with offload) wrap forward: the patch goes under them."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Counting(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = tiny_model("llama")
    hooks.add_hook_to_module(model.model.norm, Counting())
    x = torch.randn(2, model.config.hidden_size, device=DEVICE)
    with torch.no_grad():
        expected = model.model.norm(x)
    tigon.patch(model)
    assert hasattr(vars(model.model.norm)["_old_forward"], "_tigon")
    before = Counting.calls
    with torch.no_grad():
        assert rel(model.model.norm(x), expected) < 1e-6
    assert Counting.calls == before + 1
    tigon.unpatch()
    assert not hasattr(vars(model.model.norm)["_old_forward"], "_tigon")


@pytest.mark.parametrize("model_type", ["mamba2", "granitemoehybrid"])
def test_gated_norms_are_left_alone(model_type):
    """Mamba-style gated RMSNorms (norm(x, gate)) match the RMSNorm formula when called with one
    argument; replacing them with a one-input forward broke the model (a TypeError)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    size = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, n_groups=1)
    extra = dict(mamba2=dict(num_heads=4, head_dim=32, state_size=16, expand=2, chunk_size=8),
                 granitemoehybrid=dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                       mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                       mamba_chunk_size=8, num_local_experts=2, num_experts_per_tok=1,
                                       shared_intermediate_size=64, layer_types=["mamba", "attention"]))
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **size, **extra[model_type])
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    patched = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 16), device=DEVICE)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    report = tigon.patch(patched)
    assert any("gated norm" in why for piece, why in report.skipped if piece == "rms_norm"), str(report)
    with torch.no_grad():
        assert rel(patched(input_ids=ids).logits, expected) < 1e-5


def test_falcon_h1_mlp_multipliers_are_patched_by_structure():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("falcon_h1", vocab_size=100, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                                  mamba_n_groups=1, mamba_chunk_size=8, mlp_multipliers=[0.7, 1.3])
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    mlp = model.model.layers[0].feed_forward
    x = torch.randn(5, 64, device=DEVICE, requires_grad=True)
    expected = mlp(x)
    (g_expected,) = torch.autograd.grad(expected.sum(), x)
    report = tigon.patch(model)
    assert "swiglu" in report.pieces(), str(report)
    out = mlp(x)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert rel(out, expected) < 1e-5 and rel(g, g_expected) < 1e-5
