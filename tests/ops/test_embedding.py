import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tests.ops.test_cross_entropy import check_compiled, make_target, opcheck_all_succeed
from tigon import functional as TF
from tigon.ops import TiedGradSlot
from tigon.ops.embedding import SEGMENT_ROWS, embedding_backward_accumulate_
from tigon.reference import cross_entropy_ref, embedding_ref

# (vocab, hidden, ids shape)
SHAPES = pick(cpu=[(37, 19, (3, 29)), (301, 300, (83,))], gpu=[(128256, 2048, (8, 1024)), (1003, 4099, (3, 777))])


def make_ids(vocab, shape, repeats=True):
    ids = torch.randint(0, vocab, shape, device=DEVICE)
    if repeats:  # a token in every 5th position, and one run over more than two segment tiles
        flat = ids.view(-1)
        flat[::5] = vocab - 1
        flat[: 2 * SEGMENT_ROWS + 7] = 3
    return ids


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding_matches_torch(shape, dtype, padding_idx):
    vocab, hidden, ids_shape = shape
    ids = make_ids(vocab, ids_shape)
    w = randn((vocab, hidden), dtype, requires_grad=True)
    check_op(lambda w: TF.embedding(ids, w, padding_idx), lambda w: embedding_ref(ids, w, padding_idx), [w],
             dtype=dtype, what=f"embedding[{ids_shape}, padding_idx={padding_idx}]")


def test_embedding_backward_adds_into_existing_gradient():
    vocab, hidden = 41, 23
    ids = make_ids(vocab, (5, 17))
    g = randn((5, 17, hidden), torch.float32, non_contiguous=True)
    base = randn((vocab, hidden), torch.float32)
    expected = base.double().index_add(0, ids.reshape(-1), g.double().reshape(-1, hidden))
    out = embedding_backward_accumulate_(base.clone(), ids, g)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)


def test_embedding_all_padding_gets_no_gradient():
    w = randn((13, 8), torch.float32, requires_grad=True)
    ids = torch.full((4, 9), 5, device=DEVICE)
    TF.embedding(ids, w, padding_idx=5).sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_embedding_bad_inputs():
    w = randn((13, 8), torch.float32)
    with pytest.raises(TypeError, match="ids"):
        TF.embedding(torch.zeros(3, device=DEVICE), w)
    with pytest.raises(ValueError, match="padding_idx"):
        TF.embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), w, padding_idx=13)
    with pytest.raises(ValueError, match="weight"):
        TF.embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), w[0])


# ---- tied input embedding and FLCE head sharing one gradient buffer ----

class SpySlot(TiedGradSlot):
    """Records what was offered and taken, to check the shared-buffer path ran."""

    def __init__(self):
        super().__init__()
        self.offered = []
        self.taken = []

    def offer(self, grad_weight):
        accepted = super().offer(grad_weight)
        self.offered.append((grad_weight.data_ptr(), accepted))
        return accepted

    def take(self):
        grad = super().take()
        self.taken.append(None if grad is None else grad.data_ptr())
        return grad


def tied_lm(ids, w, mix, target, slot=None, **flce):
    """A tiny tied-embedding LM: embed, one linear mix, FLCE through the same weight."""
    h = TF.embedding(ids, w, tied_slot=slot) @ mix
    return TF.fused_linear_cross_entropy(h, w, target.view(-1), tied_slot=slot, **flce)


def ref_tied_lm(ids, w, mix, target, reduction="mean"):
    h = embedding_ref(ids, w) @ mix.to(w.dtype)
    return cross_entropy_ref(h.reshape(-1, h.shape[-1]) @ w.t(), target.view(-1), reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_tied_embedding_and_flce_match_torch(dtype, reduction):
    vocab, hidden = 301, 24
    ids = make_ids(vocab, (3, 29))
    target = make_target(ids.numel(), vocab).view(ids.shape)
    w = randn((vocab, hidden), dtype, scale=0.5, requires_grad=True)
    mix = randn((hidden, hidden), dtype, scale=hidden**-0.5, requires_grad=True)
    slots = []

    def ours(w, mix):
        slots.append(SpySlot())
        return tied_lm(ids, w, mix, target, slots[-1], reduction=reduction)

    check_op(ours, lambda w, mix: ref_tied_lm(ids, w, mix, target, reduction), [w, mix], dtype=dtype,
             tol=1e-4 if dtype == torch.float32 else 2e-2, noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else 2e-5,
             worse_than_eager=3.0, what=f"tied embedding + flce [{reduction}]")
    offered = [accepted for s in slots for _, accepted in s.offered]
    assert offered and all(offered), "the head did not hand its gradient to the embedding"


def tied_case(vocab, hidden, ids_shape, mix_requires_grad=True):
    """(ids, target, tied weight, mix) in fp32 for the tiny tied LM."""
    ids = make_ids(vocab, ids_shape)
    target = make_target(ids.numel(), vocab).view(ids.shape)
    w = randn((vocab, hidden), torch.float32, scale=0.5, requires_grad=True)
    mix = randn((hidden, hidden), torch.float32, scale=hidden**-0.5, requires_grad=mix_requires_grad)
    return ids, target, w, mix


def test_tied_gradient_is_one_buffer_and_accumulates():
    ids, target, w, mix = tied_case(97, 16, (2, 21))
    w64, mix64 = (t.detach().double().requires_grad_(True) for t in (w, mix))
    for step in range(2):  # the second backward accumulates into .grad
        slot = SpySlot()
        tied_lm(ids, w, mix, target, slot).backward()
        ref_tied_lm(ids, w64, mix64, target).backward()
        (ptr, accepted), = slot.offered
        assert accepted and slot.taken == [ptr]
        if step == 0:  # autograd kept the head's buffer as .grad: no second [V, H] gradient
            assert w.grad.data_ptr() == ptr
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_tied_gradient_with_another_use_of_the_weight():
    ids, target, w, mix = tied_case(53, 12, (2, 19), mix_requires_grad=False)
    w64 = w.detach().double().requires_grad_(True)
    (tied_lm(ids, w, mix, target, SpySlot()) + 0.3 * w.square().sum()).backward()
    (ref_tied_lm(ids, w64, mix.double(), target) + 0.3 * w64.square().sum()).backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_tied_slot_falls_back_when_the_embedding_does_not_run_backward():
    ids, target, w, mix = tied_case(53, 12, (2, 19))
    # Gradient for mix only: the embedding's node is not on the path, the head keeps its gradient.
    slot = SpySlot()
    (g_mix,) = torch.autograd.grad(tied_lm(ids, w, mix, target, slot), [mix])
    assert slot.offered and not slot.offered[0][1] and slot.grad is None
    # No embedding call in the forward (inputs_embeds-style): the slot has no node, same fallback.
    slot = SpySlot()
    h = torch.nn.functional.embedding(ids, w) @ mix
    TF.fused_linear_cross_entropy(h, w, target.view(-1), tied_slot=slot).backward()
    w64 = w.detach().double().requires_grad_(True)
    ref_tied_lm(ids, w64, mix.detach().double(), target).backward()
    assert slot.offered == [(slot.offered[0][0], False)]
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


# ---- the custom ops: opcheck, torch.compile ----

@pytest.mark.parametrize("padding_idx", [None, 3, -1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_op_passes_opcheck(padding_idx, dtype):
    """Schema, autograd registration, fake implementation and AOTAutograd (dynamic shapes)."""
    from tigon.ops import embedding_op

    vocab, hidden = 37, 19
    w = randn((vocab, hidden), dtype, requires_grad=True)
    opcheck_all_succeed(embedding_op, (make_ids(vocab, (3, 29)), w, padding_idx))


def test_embedding_backward_op_passes_opcheck():
    """tigon::embedding_backward, checked with grad mode off: a backward, with no autograd
    formula of its own (no double backward)."""
    from tigon.ops import embedding_backward_op

    vocab, hidden = 37, 19
    grad_out = randn((3, 29, hidden), torch.float32, requires_grad=True)
    with torch.no_grad():
        for padding_idx in (None, 3):
            opcheck_all_succeed(embedding_backward_op, (grad_out, make_ids(vocab, (3, 29)), vocab, padding_idx))


def test_embedding_compiles_without_graph_breaks():
    vocab, hidden = 37, 19
    shapes = [[randn((vocab, hidden), torch.float32, requires_grad=True), make_ids(vocab, ids_shape)]
              for ids_shape in ((3, 29), (2, 71))]
    check_compiled(lambda w, ids: TF.embedding(ids, w, padding_idx=3), shapes[0], shapes=shapes)


def test_tied_lm_compiles_without_graph_breaks_and_without_the_slot():
    """Under torch.compile the slot is not used (each op returns its own gradient): the tied LM
    gives eager's loss and gradients in one graph, and no gradient is offered."""
    vocab, hidden = 53, 12
    slots = []

    def fn(w, mix, ids, target):
        slots.append(SpySlot())
        return tied_lm(ids, w, mix, target, slots[-1])

    shapes = []
    for ids_shape in ((2, 19), (3, 11)):
        ids, target, w, mix = tied_case(vocab, hidden, ids_shape)
        shapes.append([w, mix, ids, target])
    check_compiled(fn, shapes[0], shapes=shapes)
    compiled = torch.compile(fn, backend="aot_eager", dynamic=True)
    slots.clear()
    compiled(*shapes[0]).backward()
    torch._dynamo.reset()
    assert slots and not any(s.offered for s in slots)


def test_padding_idx_type_error_before_the_op():
    w = randn((13, 8), torch.float32)
    with pytest.raises(TypeError, match="padding_idx must be an int or None"):
        TF.embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), w, padding_idx=2.0)
