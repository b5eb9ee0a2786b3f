import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.ops import glu_down
from tigon.reference import glu_ref

SHAPES = pick(cpu=[(2, 3, 37), (5, 1100), (1, 7)], gpu=[(4, 1024, 14336), (8191, 11008), (3, 4099)])


def ours(activation):
    if activation == "silu":
        return TF.swiglu
    return lambda a, b: TF.geglu(a, b, approximate="tanh" if activation == "gelu_tanh" else "none")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu_erf"])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_glu_matches_reference(shape, dtype, activation, non_contiguous):
    a = randn(shape, dtype, scale=3.0, non_contiguous=non_contiguous, requires_grad=True)
    b = randn(shape, dtype, requires_grad=True)
    check_op(ours(activation), lambda a, b: glu_ref(a, b, activation), [a, b], dtype=dtype, what=activation)


def test_glu_on_halves_of_a_fused_projection():
    """a and b as the two halves of one gate_up output: strided views, read without a copy."""
    gate_up = randn(pick((6, 2 * 45), (4096, 2 * 8192)), torch.bfloat16, requires_grad=True)
    check_op(lambda g: TF.swiglu(*g.chunk(2, dim=-1)), lambda g: glu_ref(*g.chunk(2, dim=-1), "silu"),
             [gate_up], dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_slices", [False, True])
def test_glu_down_proj_matches_reference(dtype, activation, bias, row_slices, monkeypatch):
    """Whole, and with the forward in row slices (4 on the CPU: 3, 3, 3, 1 rows)."""
    if row_slices:
        monkeypatch.setattr(glu_down, "DOWN_PROJ_MIN_SLICE_ROWS", 1)
    tokens, hidden, inter = pick((2, 5, 24), (2, 1024, 4096))[:2], pick(24, 2048), pick(40, 5632)
    a = randn((*tokens, inter), dtype, scale=2.0, requires_grad=True)
    b = randn((*tokens, inter), dtype, requires_grad=True)
    w = randn((hidden, inter), dtype, scale=inter**-0.5, requires_grad=True)
    bvec = randn((hidden,), dtype, requires_grad=True) if bias else None

    def ref(a, b, w, bvec):
        return torch.nn.functional.linear(glu_ref(a, b, activation), w, bvec)

    # The down projection is a matmul: in fp32 it may run in tf32 on the GPU.
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    check_op(lambda a, b, w, bvec: TF.glu_down_proj(a, b, w, bvec, activation), ref, [a, b, w, bvec],
             dtype=dtype, tol=tol, what=f"glu_down_proj[{activation}, row slices {row_slices}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fused_halves", [False, True])
def test_glu_down_proj_backward_in_column_slices(dtype, inplace, fused_halves):
    """The backward in ragged column slices (3 slices of 16, 16, 8 columns on the CPU), writing
    da / db over a / b or not, with a and b as plain tensors or halves of one gate_up output."""
    tokens, hidden, inter = pick((3, 7), (2, 1023)), pick(24, 2048), pick(40, 5632 + 64)
    slice_columns = pick(16, 2048)
    x = randn((*tokens, hidden), dtype, requires_grad=True)
    wg = randn((2 * inter, hidden), dtype, scale=hidden**-0.5, requires_grad=True)
    wd = randn((hidden, inter), dtype, scale=inter**-0.5, requires_grad=True)

    def projections(x, wg):
        gate_up = torch.nn.functional.linear(x, wg)
        if fused_halves:
            return gate_up.chunk(2, dim=-1)
        return gate_up[..., :inter].contiguous(), gate_up[..., inter:].contiguous()

    def fn(x, wg, wd):
        return glu_down.glu_down_proj(*projections(x, wg), wd, None, "silu", inplace=inplace,
                                     slice_columns=slice_columns)

    def ref(x, wg, wd):
        return torch.nn.functional.linear(glu_ref(*projections(x, wg), "silu"), wd)

    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    check_op(fn, ref, [x, wg, wd], dtype=dtype, tol=tol, what="glu_down_proj slices")


def test_glu_down_proj_inplace_guards():
    """After writing over a and b, a second backward raises, and so does another reader of a."""
    a0 = randn((5, 40), torch.float32, requires_grad=True)
    b0 = randn((5, 40), torch.float32, requires_grad=True)
    w = randn((8, 40), torch.float32, requires_grad=True)
    out = TF.glu_down_proj(a0 * 2, b0 * 2, w, inplace=True).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        out.backward()
    a = a0 * 2
    other = (a**2).sum()  # created first, so its backward runs after the GLU's and reads a
    out = TF.glu_down_proj(a, b0 * 2, w, inplace=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out + other).backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_multipliers_match_reference(dtype, activation):
    """Falcon-H1's MLP: act(a * gate_multiplier) * b, and the output scaled by down_multiplier,
    in the elementwise op and in the fused down projection (with a bias: (c W^T + bias) * d)."""
    a = randn((3, 37), dtype, scale=2.0, requires_grad=True)
    b = randn((3, 37), dtype, requires_grad=True)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    fn = (lambda a, b: TF.swiglu(a, b, gate_multiplier=0.7)) if activation == "silu" else \
        (lambda a, b: TF.geglu(a, b, approximate, gate_multiplier=0.7))
    check_op(fn, lambda a, b: glu_ref(a * 0.7, b, activation), [a, b], dtype=dtype, what="glu multipliers")
    w = randn((24, 37), dtype, scale=37**-0.5, requires_grad=True)
    bias = randn((24,), dtype, requires_grad=True)

    def ref(a, b, w, bias):
        return torch.nn.functional.linear(glu_ref(a * 0.7, b, activation), w, bias) * 1.3

    check_op(lambda a, b, w, bias: TF.glu_down_proj(a, b, w, activation=activation, gate_multiplier=0.7,
                                                    down_multiplier=1.3, down_bias=bias),
             ref, [a, b, w, bias], dtype=dtype, tol=1e-2 if dtype == torch.bfloat16 else 1e-3, what="glu_down_proj")


def test_activation_names():
    from tigon.ops.glu import activation_name

    assert activation_name("gelu_pytorch_tanh") == "gelu_tanh" and activation_name("swish") == "silu"
    with pytest.raises(ValueError, match="activation 'relu' is not one tigon fuses"):
        activation_name("relu")


def test_glu_bad_inputs():
    a = randn((4, 16), torch.float32)
    with pytest.raises(ValueError, match="b has shape"):
        TF.swiglu(a, randn((4, 15), torch.float32))
    with pytest.raises(TypeError, match="b has dtype"):
        TF.swiglu(a, randn((4, 16), torch.bfloat16))
    with pytest.raises(ValueError, match="approximate"):
        TF.geglu(a, a, approximate="sigmoid")
    with pytest.raises(ValueError, match="down_weight"):
        TF.glu_down_proj(a, a, randn((8, 15), torch.float32))


def assert_opcheck(op, args):
    assert set(torch.library.opcheck(getattr(op, "library_op", op), args).values()) == {"SUCCESS"}


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu_erf"])
@pytest.mark.parametrize("halves", [False, True])
def test_glu_custom_ops_pass_opcheck(activation, halves):
    from tigon.ops.glu import glu_backward_op, glu_op

    if halves:  # strided views of one gate_up output
        a, b = randn((3, 5, 2 * 37), torch.float32, requires_grad=True).chunk(2, dim=-1)
    else:
        a, b = (randn((3, 5, 37), torch.float32, requires_grad=True) for _ in range(2))
    assert_opcheck(glu_op.library_op, (a, b, activation, 0.7, 1.3))
    dc = randn((3, 5, 37), torch.float32)
    assert_opcheck(glu_backward_op.library_op, (dc, a.detach(), b.detach(), activation, 0.7, 1.3))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_glu_down_custom_ops_pass_opcheck(bias, inplace):
    from tigon.ops.glu_down import glu_down_backward_inplace_op, glu_down_backward_op, glu_down_op

    a = randn((2, 5, 40), torch.float32, requires_grad=True)
    b = randn((2, 5, 40), torch.float32, requires_grad=True)
    w = randn((24, 40), torch.float32, scale=40**-0.5, requires_grad=True)
    bvec = randn((24,), torch.float32, requires_grad=True) if bias else None
    options = ("gelu_tanh", 0.7, 1.3, torch.float32)
    assert_opcheck(glu_down_op.library_op, (a, b, w, bvec, *options, inplace, 16))
    a, b, w, bvec = (None if t is None else t.detach() for t in (a, b, w, bvec))  # backward ops: no autograd
    dout = randn((2, 5, 24), torch.float32)
    assert_opcheck(glu_down_backward_op.library_op, (dout, a, b, w, bvec, *options, 16, True, True, bias))
    assert_opcheck(glu_down_backward_inplace_op.library_op,
                   (dout, a.clone(), b.clone(), w, bvec, *options, 16, True, bias))


@pytest.mark.parametrize("activation", ["silu", "gelu_erf"])
def test_glu_compiles_without_graph_breaks(activation):
    gate_up = randn((3, 5, 2 * 37), torch.float32, scale=2.0, requires_grad=True)

    def loss(gate_up):
        return (TF.glu(*gate_up.chunk(2, dim=-1), activation, gate_multiplier=0.7, out_multiplier=1.3) ** 2).sum()

    assert_compiles_like_eager(loss, [gate_up])


@pytest.mark.parametrize("inplace", [False, True])
def test_glu_down_proj_compiles_without_graph_breaks(inplace):
    """Under torch.compile the backward does not write over a and b (the graph owns them): the
    eager result, inplace or not."""
    a = randn((2, 5, 40), torch.float32, scale=2.0, requires_grad=True)
    b = randn((2, 5, 40), torch.float32, requires_grad=True)
    w = randn((24, 40), torch.float32, scale=40**-0.5, requires_grad=True)
    bvec = randn((24,), torch.float32, requires_grad=True)

    def loss(a, b, w, bvec):
        out = TF.glu_down_proj(a * 1.5, b * 1.5, w, bvec, "gelu_tanh", inplace=inplace, gate_multiplier=0.7,
                               down_multiplier=1.3)
        return (out**2).sum()

    assert_compiles_like_eager(loss, [a, b, w, bvec])


@pytest.mark.gpu
def test_swiglu_past_2_31_elements():
    """Contiguous inputs are flattened into one row of > 2^31 elements: int64 offsets throughout."""
    cols = 14336
    rows = 2**31 // cols + 16
    a = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    b = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    c = TF.swiglu(a, b)
    dc = torch.randn_like(c)
    da, db = torch.autograd.grad(c, (a, b), dc)
    tail = slice(rows - 32, rows)
    a64, b64 = a[tail].detach().double().requires_grad_(), b[tail].detach().double().requires_grad_()
    c64 = torch.nn.functional.silu(a64) * b64
    da64, db64 = torch.autograd.grad(c64, (a64, b64), dc[tail].double())
    for ours, ref in ((c[tail], c64), (da[tail], da64), (db[tail], db64)):
        torch.testing.assert_close(ours.double(), ref, atol=3e-2, rtol=2e-2)
