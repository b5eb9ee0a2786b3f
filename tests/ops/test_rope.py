import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.reference import rope_interleaved_ref, rope_ref

# (batch, q heads, kv heads, tokens, head dim)
SHAPES = pick(
    cpu=[(2, 4, 2, 5, 16), (1, 3, 3, 7, 12), (2, 6, 1, 3, 64)],
    gpu=[(4, 32, 8, 2048, 128), (2, 28, 4, 1000, 128), (1, 24, 8, 513, 96), (2, 8, 1, 4096, 256)],
)


def hf_cos_sin(batch, tokens, rot, dtype, per_sequence=False, base=10000.0):
    """cos, sin [B|1, T, R] as HF's rotary embedding makes them (duplicated halves)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    pos = torch.arange(tokens, dtype=torch.float64)[None].repeat(batch if per_sequence else 1, 1)
    if per_sequence:
        pos = pos + torch.arange(batch, dtype=torch.float64)[:, None] * 3
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    from tests.helpers import DEVICE
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def make_qk(shape, dtype, layout, non_contiguous):
    batch, hq, hk, tokens, dim = shape
    if layout == "bhtd" and non_contiguous:
        # HF's layout: projection output [B, T, H*D] viewed [B, T, H, D] and transposed.
        q = randn((batch, tokens, hq, dim), dtype).transpose(1, 2).detach().requires_grad_()
        k = randn((batch, tokens, hk, dim), dtype).transpose(1, 2).detach().requires_grad_()
        return q, k
    if layout == "bhtd":
        return (randn((batch, hq, tokens, dim), dtype, requires_grad=True),
                randn((batch, hk, tokens, dim), dtype, requires_grad=True))
    return (randn((batch, tokens, hq, dim), dtype, non_contiguous=non_contiguous, requires_grad=True),
            randn((batch, tokens, hk, dim), dtype, non_contiguous=non_contiguous, requires_grad=True))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_rope_matches_hf(shape, dtype, layout, non_contiguous):
    q, k = make_qk(shape, dtype, layout, non_contiguous)
    assert q.is_contiguous() != non_contiguous
    unsqueeze_dim = 1 if layout == "bhtd" else 2
    cos, sin = hf_cos_sin(shape[0], shape[3], shape[4], dtype)
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim),
             lambda q, k: rope_ref(q, k, cos.to(q.dtype), sin.to(q.dtype), unsqueeze_dim),
             [q, k], dtype=dtype, what=f"rope[{layout}]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_per_sequence_cos_and_partial_rotary(dtype):
    """cos of batch B (one row of positions per sequence), and R < D (Phi-3's partial rotary)."""
    batch, hq, hk, tokens, dim = pick((3, 4, 2, 6, 20), (4, 32, 8, 1024, 96))
    rot = dim // 2 if dim % 4 == 0 else dim - 4
    q, k = make_qk((batch, hq, hk, tokens, dim), dtype, "bhtd", True)
    cos, sin = hf_cos_sin(batch, tokens, rot, dtype, per_sequence=True)
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin),
             lambda q, k: rope_ref(q, k, cos.to(q.dtype), sin.to(q.dtype)), [q, k], dtype=dtype)


# (head dim D, rotary dim R): R < D not dividing D, D - R > R, D - R not a power of two, odd D,
# and R == D.
PARTIAL_ROTARY = [(100, 16), (96, 40), (80, 48), (72, 24), (128, 48), (64, 64), (65, 32), (67, 66)]


@pytest.mark.parametrize("dim,rot", PARTIAL_ROTARY)
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("positions", [False, True])
def test_rope_partial_rotary_matches_hf(dim, rot, layout, positions):
    """HF's Phi-3 apply_rotary_pos_emb (rotate the first R = cos.shape[-1] dims, pass the rest
    through) and, for R == D, Llama's, on HF's transposed q / k views; with position_ids, tigon
    gathers from the table what the reference is given gathered."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    batch, hq, hk, tokens = 2, 3, 1, 5
    unsqueeze_dim = 1 if layout == "bhtd" else 2
    q, k = make_qk((batch, hq, hk, tokens, dim), torch.float32, layout, non_contiguous=True)
    if positions:
        table = 11
        cos_t, sin_t = hf_cos_sin(1, table, rot, torch.float32)
        pos = torch.randint(0, table, (batch, tokens), device=q.device)
        args = (cos_t[0], sin_t[0], pos)
        cos, sin = cos_t[0][pos], sin_t[0][pos]
    else:
        cos, sin = hf_cos_sin(batch, tokens, rot, torch.float32, per_sequence=True)
        args = (cos, sin, None)
    ref = llama_rope if rot == dim else phi3_rope
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, *args, unsqueeze_dim=unsqueeze_dim),
             lambda q, k: ref(q, k, cos.to(q.dtype), sin.to(q.dtype), unsqueeze_dim=unsqueeze_dim),
             [q, k], dtype=torch.float32, what=f"rope[D={dim}, R={rot}, {layout}]")


# (batch, q heads, kv heads, tokens, head dim D, rotary dim R, layout): an odd R = D (HF's
# Llama formula: rotate_half splits x into x[:R//2] and the one longer x[R//2:]) on HF's transposed
# views and on a row-padded [B, T, H, D] with more k heads than q heads; an odd R < D (Phi-3's).
ODD_HEAD_DIMS = [(1, 3, 2, 3, 41, 41, "bhtd"), (1, 2, 3, 3, 7, 7, "bthd"), (2, 2, 1, 2, 9, 5, "bhtd")]


@pytest.mark.parametrize("case", ODD_HEAD_DIMS, ids=lambda c: f"D{c[4]}-R{c[5]}-{c[6]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_odd_head_dim_matches_hf(case, dtype):
    """HF's formula for an odd rotated dim R, element-wise as written: out[j] = x[j] c[j] -
    x[j + R//2] s[j] for j <= R//2, x[j] c[j] + x[j - R//2 - 1] s[j] after. cos / sin are arbitrary
    (halves not duplicated), so every element's own angle and partner are checked."""
    batch, hq, hk, tokens, dim, rot, layout = case
    unsqueeze_dim = 1 if layout == "bhtd" else 2
    q, k = make_qk((batch, hq, hk, tokens, dim), dtype, layout, non_contiguous=True)
    assert not q.is_contiguous()
    cos, sin = randn((batch, tokens, rot), dtype), randn((batch, tokens, rot), dtype)
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim),
             lambda q, k: rope_ref(q, k, cos.to(q.dtype), sin.to(q.dtype), unsqueeze_dim),
             [q, k], dtype=dtype, what=f"rope[D={dim}, R={rot}, {layout}]")


def test_rope_more_angles_than_head_dims_is_refused():
    """Liger-Kernel's odd case: a rotary embedding built for head dim 41 gives cos / sin of width
    42 (cat(freqs, freqs) of 21 frequencies), where HF's q * cos does not broadcast: refused,
    naming cos. So is a cos of width 1 (HF's Llama formula would broadcast it, Phi-3's rotate one dim)."""
    q, k = make_qk((1, 2, 1, 3, 41), torch.float32, "bhtd", False)
    cos, sin = hf_cos_sin(1, 3, 41, torch.float32)
    with pytest.raises(RuntimeError):
        rope_ref(q, k, cos, sin)
    with pytest.raises(ValueError, match="cos's last dim 42 is more than the head dim 41"):
        TF.apply_rotary_pos_emb(q, k, cos, sin)
    with pytest.raises(ValueError, match="cos's last dim 1 must be at least 2"):
        TF.apply_rotary_pos_emb(q, k, cos[..., :1], sin[..., :1])


def test_rope_zero_stride_inputs():
    """q expanded over batch and heads, k over heads (as repeat_kv), cos / sin over batch and
    position_ids over batch (HF's arange(T)[None].expand(B, -1)): torch's values and the
    gradients of the leaves."""
    batch, hq, hk, tokens, dim = 2, 4, 2, 5, 16
    qb = randn((1, 1, tokens, dim), torch.float32, requires_grad=True)
    kb = randn((batch, 1, tokens, dim), torch.float32, requires_grad=True)
    cos, sin = hf_cos_sin(1, tokens, dim, torch.float32)
    cos_b, sin_b = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)

    def expand(qb, kb):
        return qb.expand(batch, hq, tokens, dim), kb.expand(batch, hk, tokens, dim)

    check_op(lambda qb, kb: TF.apply_rotary_pos_emb(*expand(qb, kb), cos_b, sin_b),
             lambda qb, kb: rope_ref(*expand(qb, kb), cos, sin), [qb, kb], dtype=torch.float32)
    table_cos, table_sin = hf_cos_sin(1, 9, dim, torch.float32)
    pos = torch.arange(2, 2 + tokens, device=qb.device)[None].expand(batch, -1)
    check_op(lambda qb, kb: TF.apply_rotary_pos_emb(*expand(qb, kb), table_cos[0], table_sin[0], position_ids=pos),
             lambda qb, kb: rope_ref(*expand(qb, kb), table_cos[:, 2:2 + tokens], table_sin[:, 2:2 + tokens]),
             [qb, kb], dtype=torch.float32)


def test_rope_second_backward_over_retained_graph():
    q, k = make_qk((2, 4, 2, 5, 16), torch.float32, "bhtd", True)
    cos, sin = hf_cos_sin(2, 5, 12, torch.float32)
    oq, ok = TF.apply_rotary_pos_emb(q, k, cos, sin)
    loss = 0.5 * ((oq * randn(oq.shape, torch.float32)).sum() + (ok * randn(ok.shape, torch.float32)).sum())
    loss.backward(retain_graph=True)
    once = [q.grad.clone(), k.grad.clone()]
    loss.backward()
    assert torch.equal(q.grad, 2 * once[0]) and torch.equal(k.grad, 2 * once[1])


def test_rope_unequal_halves_of_cos_sin():
    """Arbitrary cos / sin (halves differ): the backward is the true transpose, not a sign flip."""
    batch, hq, hk, tokens, dim = 2, 3, 1, 5, 8
    q, k = make_qk((batch, hq, hk, tokens, dim), torch.float32, "bhtd", False)
    cos = randn((1, tokens, dim), torch.float32)
    sin = randn((1, tokens, dim), torch.float32)
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin), lambda q, k: rope_ref(q, k, cos, sin),
             [q, k], dtype=torch.float32)


@pytest.mark.parametrize("pos_batch", [1, 2])
def test_rope_position_ids_gather_from_table(pos_batch):
    batch, hq, hk, tokens, dim, table = 2, 4, 2, 6, 16, 40
    q, k = make_qk((batch, hq, hk, tokens, dim), torch.float32, "bhtd", True)
    cos_t, sin_t = hf_cos_sin(1, table, dim, torch.float32)
    pos = torch.randint(0, table, (pos_batch, tokens), device=q.device)
    cos, sin = cos_t[0][pos], sin_t[0][pos]  # [pos_batch, T, D], what the kernel gathers
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos_t, sin_t, position_ids=pos),
             lambda q, k: rope_ref(q, k, cos, sin), [q, k], dtype=torch.float32)


@pytest.mark.parametrize("non_contiguous", [False, True])
def test_rope_gradients_take_the_inputs_layout(non_contiguous):
    """The backward writes dq / dk in q's / k's layouts (HF's q is a transposed view of the
    projection: its gradient must be one too, so the view's backward copies nothing), whatever
    the layout of the incoming gradients, with the values of the reference."""
    shape = (2, 4, 2, 5, 16)
    q, k = make_qk(shape, torch.float32, "bhtd", non_contiguous)
    cos, sin = hf_cos_sin(shape[0], shape[3], shape[4], torch.float32)
    out_q, out_k = TF.apply_rotary_pos_emb(q, k, cos, sin)
    # Incoming gradients in the other layout than q's.
    gq = randn(out_q.shape, torch.float32) if non_contiguous else randn((2, 5, 4, 16), torch.float32).transpose(1, 2)
    gk = randn(out_k.shape, torch.float32) if non_contiguous else randn((2, 5, 2, 16), torch.float32).transpose(1, 2)
    dq, dk = torch.autograd.grad((out_q, out_k), (q, k), (gq, gk))
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    rq, rk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref_q, ref_k = torch.autograd.grad(rope_ref(rq, rk, cos, sin), (rq, rk), (gq, gk))
    torch.testing.assert_close(dq, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, ref_k, rtol=1e-5, atol=1e-5)


def test_rope_bad_inputs():
    q, k = make_qk((2, 4, 2, 5, 16), torch.float32, "bhtd", False)
    cos, sin = hf_cos_sin(1, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="k has shape"):
        TF.apply_rotary_pos_emb(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match="cos has 5 positions but q has 4 tokens"):
        TF.apply_rotary_pos_emb(q[:, :, :4], k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match="cos's last dim 0 must be at least 2"):
        TF.apply_rotary_pos_emb(q, k, cos[..., :0], sin[..., :0])
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        TF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="position_ids range"):
        TF.apply_rotary_pos_emb(q, k, cos[0], sin[0], position_ids=torch.full((1, 5), 9, device=q.device))
    with pytest.raises(ValueError, match="require grad"):
        TF.apply_rotary_pos_emb(q, k, cos.clone().requires_grad_(), sin)


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("non_contiguous", [False, True])
@pytest.mark.parametrize("positions", [False, True])
def test_rope_custom_ops_pass_opcheck(layout, non_contiguous, positions):
    """tigon::rope on HF's transposed views and contiguous q / k, partial rotary, and its
    backward writing q's layout."""
    from tigon.ops.rope import dense_strides, rope_backward_op, rope_op

    batch, hq, hk, tokens, dim, rot = 2, 3, 1, 5, 12, 8
    unsqueeze_dim = 1 if layout == "bhtd" else 2
    q, k = make_qk((batch, hq, hk, tokens, dim), torch.float32, layout, non_contiguous)
    if positions:
        cos, sin, pos = randn((9, rot), torch.float32), randn((9, rot), torch.float32), \
            torch.randint(0, 9, (batch, tokens), device=q.device)
    else:
        cos, sin, pos = randn((1, tokens, rot), torch.float32), randn((1, tokens, rot), torch.float32), None
    assert set(torch.library.opcheck(rope_op.library_op, (q, k, cos, sin, pos, unsqueeze_dim)).values()) == {"SUCCESS"}
    strides = [list(dense_strides(t) or ()) for t in (q, k)]
    grads = (randn(q.shape, torch.float32), randn(k.shape, torch.float32))
    checks = torch.library.opcheck(rope_backward_op.library_op, (*grads, cos, sin, pos, unsqueeze_dim, *strides))
    assert set(checks.values()) == {"SUCCESS"}


@pytest.mark.parametrize("positions", [False, True])
def test_rope_compiles_without_graph_breaks(positions):
    """HF's q / k (transposed views of the projections) through torch.compile: eager's values
    and gradients, one graph."""
    batch, hq, hk, tokens, dim = 2, 3, 1, 5, 16
    proj_q = randn((batch, tokens, hq * dim), torch.float32, requires_grad=True)
    proj_k = randn((batch, tokens, hk * dim), torch.float32, requires_grad=True)
    cos, sin = hf_cos_sin(1, 9 if positions else tokens, 12, torch.float32)
    pos = torch.arange(2, 2 + tokens, device=proj_q.device)[None].expand(batch, -1) if positions else None
    if positions:
        cos, sin = cos[0], sin[0]

    def loss(proj_q, proj_k):
        q = proj_q.view(batch, tokens, hq, dim).transpose(1, 2)
        k = proj_k.view(batch, tokens, hk, dim).transpose(1, 2)
        out_q, out_k = TF.apply_rotary_pos_emb(q, k, cos, sin, position_ids=pos)
        return (out_q * out_q).sum() + (out_k * 3.0).sum()

    assert_compiles_like_eager(loss, [proj_q, proj_k])


# ---- interleaved pairs (torchtune's layout) ----

def pair_angles(batch, tokens, n_pairs, dtype, base=10000.0):
    """cos, sin [1, T, R/2] of torchtune's rope cache (one angle per pair)."""
    theta = 1.0 / (base ** (torch.arange(0, 2 * n_pairs, 2, dtype=torch.float64) / (2 * n_pairs)))
    angles = torch.arange(tokens, dtype=torch.float64)[None, :, None] * theta
    from tests.helpers import DEVICE
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_rope_interleaved_matches_torchtune(shape, dtype, layout, partial):
    batch, hq, hk, tokens, dim = shape
    q, k = make_qk(shape, dtype, layout, non_contiguous=layout == "bhtd")
    unsqueeze_dim = 1 if layout == "bhtd" else 2
    n_pairs = dim // 4 if partial else dim // 2
    cos, sin = pair_angles(batch, tokens, n_pairs, dtype)
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=True),
             lambda q, k: (rope_interleaved_ref(q, cos.to(q.dtype), sin.to(q.dtype), unsqueeze_dim),
                           rope_interleaved_ref(k, cos.to(k.dtype), sin.to(k.dtype), unsqueeze_dim)),
             [q, k], dtype=dtype, what=f"rope interleaved[{layout}]")


def test_rope_interleaved_position_ids_and_no_k_heads():
    """torchtune rotates q and k one at a time: k may have no heads; positions gather per
    sequence (packed documents)."""
    batch, hq, tokens, dim, table = 2, 3, 6, 16, 20
    q = randn((batch, tokens, hq, dim), torch.float32, requires_grad=True)
    k = torch.empty((batch, tokens, 0, dim), device=q.device)
    cos_t, sin_t = pair_angles(1, table, dim // 2, torch.float32)
    pos = torch.randint(0, table, (batch, tokens), device=q.device)
    out, out_k = TF.apply_rotary_pos_emb(q, k, cos_t[0], sin_t[0], position_ids=pos, unsqueeze_dim=2,
                                         interleaved=True)
    assert out_k.shape == k.shape
    expected = rope_interleaved_ref(q, cos_t[0][pos], sin_t[0][pos])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    g = randn(out.shape, torch.float32)
    (dq,) = torch.autograd.grad(out, q, g)
    rq = q.detach().clone().requires_grad_()
    (ref_dq,) = torch.autograd.grad(rope_interleaved_ref(rq, cos_t[0][pos], sin_t[0][pos]), rq, g)
    torch.testing.assert_close(dq, ref_dq, rtol=1e-5, atol=1e-5)


def test_rope_interleaved_bad_tables_and_opcheck():
    from tigon.ops.rope import rope_backward_op, rope_op

    q, k = make_qk((2, 3, 1, 5, 8), torch.float32, "bthd", False)
    cos, sin = pair_angles(1, 5, 4, torch.float32)
    with pytest.raises(ValueError, match="one angle per rotated pair"):
        TF.apply_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), unsqueeze_dim=2,
                                interleaved=True)
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        TF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2, interleaved=1)
    assert set(torch.library.opcheck(rope_op.library_op, (q, k, cos, sin, None, 2, True)).values()) == {"SUCCESS"}
    grads = (randn(q.shape, torch.float32), randn(k.shape, torch.float32))
    checks = torch.library.opcheck(rope_backward_op.library_op, (*grads, cos, sin, None, 2, [], [], True))
    assert set(checks.values()) == {"SUCCESS"}
