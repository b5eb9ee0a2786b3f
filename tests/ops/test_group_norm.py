import pytest
import torch

from tests.helpers import DTYPES, check_module, check_op, pick, randn
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.nn import TigonGroupNorm
from tigon.ops import group_norm as group_norm_ops
from tigon.ops._common import next_pow2
from tigon.ops.group_norm import GroupNormConfig, group_norm_config
from tigon.reference import group_norm_ref

# (shape, groups), each in the plan group_norm_config picks. CPU: all "one_tile" (a group in one
# program's registers): masked columns (3, 6, 5), a 2 x 4200 group (2, 4, 70, 60), 24 channels a
# group (3, 192, 5), no spatial dims (5, 48); the other plans: test_group_norm_plans. GPU: "group"
# (32, 512, 64, 64), (16, 320, 3001), (8, 512, 128, 128); "tiles" (2, 64, 257, 129), (1, 32, 512, 512);
# "one_tile" (32, 512, 32, 32), (4096, 96).
CASES = pick(
    cpu=[((3, 6, 5), 3), ((2, 4, 70, 60), 2), ((3, 192, 5), 8), ((5, 48), 4)],
    gpu=[((32, 512, 64, 64), 32), ((2, 64, 257, 129), 8), ((1, 32, 512, 512), 32), ((16, 320, 3001), 32),
         ((4096, 96), 6), ((32, 512, 32, 32), 32), ((8, 512, 128, 128), 32)],
)


def check_group_norm(x, num_groups, w, b, dtype, **kwargs):
    check_op(lambda x, w, b: TF.group_norm(x, num_groups, w, b), lambda x, w, b: group_norm_ref(x, num_groups, w, b),
             [x, w, b], dtype=dtype, **kwargs)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_matches_reference(case, dtype):
    shape, groups = case
    # A common offset: the statistics must not cancel (see test_group_norm_large_offset too).
    x = randn(shape, dtype, shift=8.0, requires_grad=True)
    w = randn(shape[1:2], dtype, shift=1.0, requires_grad=True)
    b = randn(shape[1:2], dtype, requires_grad=True)
    check_group_norm(x, groups, w, b, dtype, what=f"group_norm{shape} G{groups}")


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_group_norm_partial_affine(affine):
    x = randn((3, 6, 5), torch.float32, requires_grad=True)
    w = randn((6,), torch.float32, shift=1.0, requires_grad=True) if affine == "weight" else None
    b = randn((6,), torch.float32, requires_grad=True) if affine == "bias" else None
    check_group_norm(x, 2, w, b, torch.float32, what=f"group_norm[{affine}]")


def forced_plan(plan, block_r=0, block_s=0, max_programs=0):
    """A stand-in for group_norm_config that picks ``plan``, with tiles of at most
    [block_r, block_s] (small, so that CPU shapes take several tiles a group)."""
    def config(n_samples, num_groups, channels_per_group, n_cols, device, backward=False):
        if plan == "tiles":
            return GroupNormConfig("tiles", 0, 0, 0)
        return GroupNormConfig(plan, min(block_r, next_pow2(channels_per_group)), min(block_s, next_pow2(n_cols)), 2,
                               max_programs)
    return config


@pytest.mark.parametrize("case, plan", [
    (((3, 6, 5), 3), ("tiles", 0, 0)), (((2, 4, 70, 60), 2), ("tiles", 0, 0)), (((3, 192, 5), 8), ("tiles", 0, 0)),
    (((2, 4, 70, 60), 2), ("group", 1, 1024)), (((3, 192, 5), 8), ("group", 8, 8, 5)),
    (((3, 6, 5), 3), ("one_tile", 2, 8, 4)),
], ids=["tiles-groups_in_a_tile", "tiles-segments", "tiles-straddling", "group-column_blocks",
        "group-row_blocks-5_programs", "one_tile-4_programs"])
def test_group_norm_plans(monkeypatch, case, plan):
    """Forced plans on the CPU cases (which pick "one_tile"): "tiles" with several groups in a
    tile (3, 6, 5), channels of several 4096-element segments (2, 4, 70, 60), a group of 24 rows
    straddling two tiles (3, 192, 5); "group" with several tiles a group: 5 column blocks a
    channel, or 3 blocks of 8 channels; and programs that loop over several groups."""
    monkeypatch.setattr(group_norm_ops, "group_norm_config", forced_plan(*plan))
    shape, groups = case
    x = randn(shape, torch.float32, shift=8.0, requires_grad=True)
    w = randn(shape[1:2], torch.float32, shift=1.0, requires_grad=True)
    b = randn(shape[1:2], torch.float32, requires_grad=True)
    check_group_norm(x, groups, w, b, torch.float32, what=f"group_norm{shape} G{groups} {plan}")


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_group_norm_group_plan_bfloat16_and_partial_affine(monkeypatch, affine):
    monkeypatch.setattr(group_norm_ops, "group_norm_config", forced_plan("group", 2, 16))
    x = randn((3, 6, 5, 7), torch.bfloat16, shift=1.0, requires_grad=True)
    w = randn((6,), torch.bfloat16, shift=1.0, requires_grad=True) if affine == "weight" else None
    b = randn((6,), torch.bfloat16, requires_grad=True) if affine == "bias" else None
    check_group_norm(x, 3, w, b, torch.bfloat16, what=f"group_norm[group plan, {affine}]")


def test_group_norm_chooses_its_plan():
    """A padded group of <= GROUP_TILE_MAX elements: one program holds it; larger ones: a
    program a group when there are enough groups (the interpreter counts 2 SMs), else tiles.
    The two shapes then run in the plan they pick (in the interpreter: "tiles", then "group"
    with its real tile sizes)."""
    cpu = torch.device("cpu")
    assert group_norm_config(2, 2, 2, 4200, cpu).plan == "one_tile"  # 2 x 8192 padded
    assert group_norm_config(1, 1, 5, 3000, cpu).plan == "tiles"  # 8 x 4096 padded, one group
    assert group_norm_config(2, 1, 2, 16900, cpu) == GroupNormConfig("group", 1, 16384, 16)
    assert group_norm_config(2, 1, 2, 16900, cpu, backward=True) == GroupNormConfig("group", 1, 8192, 16)
    assert group_norm_config(2, 1, 64, 300, cpu, backward=True).block_r == 16  # 16 x 512 tiles
    for shape, groups in (((1, 5, 3000), 1), ((2, 2, 130, 130), 1)):
        x = randn(shape, torch.float32, shift=20.0, requires_grad=True)
        w = randn(shape[1:2], torch.float32, shift=1.0, requires_grad=True)
        check_group_norm(x, groups, w, None, torch.float32, what=f"group_norm{shape}")


@pytest.mark.parametrize("plan", [None, ("tiles", 0, 0), ("group", 2, 512)], ids=["one_tile", "tiles", "group"])
def test_group_norm_large_offset(monkeypatch, plan):
    """|mean| = 50 std: a one-pass E[x^2] - E[x]^2 would err by ~1e-4 in fp32. one_tile: exact
    two-pass in registers; tiles: per-segment two-pass statistics and their exact combination;
    group: sums of x - (the first tile's mean). All stay at the mean's own rounding."""
    if plan is not None:
        monkeypatch.setattr(group_norm_ops, "group_norm_config", forced_plan(*plan))
    x = randn((2, 4, 70, 60), torch.float32, shift=50.0, requires_grad=True)
    w = randn((4,), torch.float32, shift=1.0, requires_grad=True)
    check_group_norm(x, 2, w, None, torch.float32)


def test_group_norm_bfloat16_input_with_float32_parameters():
    x = randn((3, 6, 10), torch.bfloat16, shift=1.0, requires_grad=True)
    w = randn((6,), torch.float32, shift=1.0, requires_grad=True)
    b = randn((6,), torch.float32, requires_grad=True)
    check_group_norm(x, 3, w, b, torch.bfloat16)


def test_group_norm_frozen_parameters_and_float16():
    x = randn((4, 6, 7), torch.float16, requires_grad=True)
    w = randn((6,), torch.float16, shift=1.0)
    b = randn((6,), torch.float16, requires_grad=True)
    check_group_norm(x, 3, w, b, torch.float16)


def test_group_norm_strided_expanded_and_channels_last_inputs():
    """A row-padded x, a channels-last x, an x expanded over the batch, weight / bias expanded
    from scalars or strided: torch's values and gradients (the kernels copy to contiguous)."""
    x = randn((3, 6, 4, 9), torch.float32, non_contiguous=True, requires_grad=True)
    w, b = randn((12,), torch.float32, requires_grad=True), randn((18,), torch.float32, requires_grad=True)
    check_op(lambda x, w, b: TF.group_norm(x, 3, w[::2], b[::3]), lambda x, w, b: group_norm_ref(x, 3, w[::2], b[::3]),
             [x, w, b], dtype=torch.float32)
    base = randn((3, 4, 5, 6), torch.float32, requires_grad=True)
    check_op(lambda x: TF.group_norm(x.permute(0, 3, 1, 2), 2), lambda x: group_norm_ref(x.permute(0, 3, 1, 2), 2),
             [base], dtype=torch.float32)
    row = randn((1, 6, 11), torch.float32, shift=2.0, requires_grad=True)
    scale = randn((), torch.float32, shift=1.0, requires_grad=True)
    shift = randn((), torch.float32, requires_grad=True)
    check_op(lambda r, s, t: TF.group_norm(r.expand(4, 6, 11), 3, s.expand(6), t.expand(6)),
             lambda r, s, t: group_norm_ref(r.expand(4, 6, 11), 3, s.expand(6), t.expand(6)), [row, scale, shift],
             dtype=torch.float32)


def test_group_norm_second_backward_over_retained_graph():
    x = randn((3, 6, 10), torch.float32, requires_grad=True)
    w = randn((6,), torch.float32, shift=1.0, requires_grad=True)
    b = randn((6,), torch.float32, requires_grad=True)
    loss = 0.5 * (TF.group_norm(x, 3, w, b) * randn((3, 6, 10), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in (x, w, b)]
    loss.backward()
    for t, g in zip((x, w, b), once):
        assert torch.equal(t.grad, 2 * g)


@pytest.mark.parametrize("plan", [None, ("tiles", 0, 0), ("group", 1, 4)], ids=["one_tile", "tiles", "group"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_group_norm_non_finite_value_stays_in_its_group(monkeypatch, bad, plan):
    """As torch: a NaN or inf makes its own (sample, group) NaN and leaves every other one exact."""
    if plan is not None:
        monkeypatch.setattr(group_norm_ops, "group_norm_config", forced_plan(*plan))
    x = randn((3, 6, 10), torch.float32)
    x[1, 2, 7] = bad  # sample 1, group 1 (of 3)
    w, b = randn((6,), torch.float32, shift=1.0), randn((6,), torch.float32)
    y, want = TF.group_norm(x, 3, w, b), group_norm_ref(x, 3, w, b)
    assert torch.isnan(y[1, 2:4]).all()
    poisoned = torch.zeros_like(x, dtype=torch.bool)
    poisoned[1, 2:4] = True
    torch.testing.assert_close(y[~poisoned], want[~poisoned], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 4, 3), (2, 4, 0), (0, 4)])
def test_group_norm_empty_batch_or_spatial_size(shape):
    x = randn(shape, torch.float32, requires_grad=True)
    w = randn((4,), torch.float32, requires_grad=True)
    b = randn((4,), torch.float32, requires_grad=True)
    y = TF.group_norm(x, 2, w, b)
    assert y.shape == torch.nn.functional.group_norm(x, 2, w, b).shape
    y.sum().backward()
    assert x.grad.shape == shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_group_norm_bad_inputs():
    x = randn((2, 6, 5), torch.float32)
    with pytest.raises(ValueError, match="not divisible by num_groups=4"):
        TF.group_norm(x, 4)
    with pytest.raises(TypeError, match="num_groups must be an int"):
        TF.group_norm(x, 2.0)
    with pytest.raises(ValueError, match="num_groups must be positive"):
        TF.group_norm(x, 0)
    with pytest.raises(ValueError, match="weight has shape"):
        TF.group_norm(x, 3, randn((5,), torch.float32))
    with pytest.raises(ValueError, match="x must have at least 2"):
        TF.group_norm(randn((6,), torch.float32), 3)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        TF.group_norm(x.double(), 3)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        TF.group_norm(x, 3, None, [0.0] * 6)
    with pytest.raises(ValueError, match="x must be"):
        TigonGroupNorm(3, 6).to(x.device)(randn((2, 4, 5), torch.float32))


def test_group_norm_custom_ops_pass_opcheck():
    from tigon.ops.group_norm import group_norm_backward_op, group_norm_op

    x = randn((2, 4, 3, 2), torch.float32, non_contiguous=True, requires_grad=True)
    w, b = randn((4,), torch.float32, requires_grad=True), None
    assert set(torch.library.opcheck(group_norm_op.library_op, (x, 2, w, b, 1e-5)).values()) == {"SUCCESS"}
    x, w, b = (None if t is None else t.detach() for t in (x, w, b))
    _, mean, rstd = group_norm_op(x, 2, w, b, 1e-5)
    dy = randn((2, 4, 3, 2), torch.float32)
    checks = torch.library.opcheck(group_norm_backward_op.library_op, (dy, x, 2, w, b, mean, rstd, True, False))
    assert set(checks.values()) == {"SUCCESS"}


def test_group_norm_compiles_without_graph_breaks():
    x = randn((3, 6, 7), torch.float32, shift=2.0, requires_grad=True)
    w = randn((6,), torch.float32, shift=1.0, requires_grad=True)
    b = randn((6,), torch.float32, requires_grad=True)
    cotangent = randn((3, 6, 7), torch.float32)

    def loss(x, w, b):
        return (TF.group_norm(x * 2.0, 3, w, b) * cotangent).sum()

    assert_compiles_like_eager(loss, [x, w, b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_module_matches_torch(dtype, affine):
    theirs = torch.nn.GroupNorm(4, 8, eps=1e-4, affine=affine)
    if affine:
        with torch.no_grad():
            theirs.weight.normal_(1.0, 0.2)
            theirs.bias.normal_(0.0, 0.2)
    x = randn((3, 8, 5, 3), dtype, shift=1.0, requires_grad=True)
    check_module(TigonGroupNorm(4, 8, eps=1e-4, affine=affine), theirs, [x], dtype=dtype,
                 what=f"TigonGroupNorm(affine={affine})")


def test_group_norm_backward_leaves_the_group_plan_when_groups_overflow_l2(monkeypatch):
    """An H100's 132 SMs on [32, 512, 128, 128] G32: the forward keeps a program a group, the
    backward (x and dy read twice) takes tiles once the groups in flight exceed L2's share."""
    monkeypatch.setattr(group_norm_ops, "persistent_programs", lambda device, n, per_sm: 132)
    cpu = torch.device("cpu")
    assert group_norm_config(32, 32, 16, 128 * 128, cpu).plan == "group"
    assert group_norm_config(32, 32, 16, 128 * 128, cpu, backward=True).plan == "tiles"
    assert group_norm_config(32, 32, 16, 32 * 64, cpu, backward=True).plan == "group"  # 132 x 32768 in flight
