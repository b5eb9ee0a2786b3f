"""How tigon meets its environment: the interpreter switch, and dtypes it refuses."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import DEVICE
from tigon import functional as TF


def test_interpreter_switched_on_after_triton_was_imported_is_a_clear_error():
    """TRITON_INTERPRET=1 set after transformers imported triton: Triton's own functions are
    compiled code, so the first kernel would fail deep in the interpreter. tigon says what to do."""
    pytest.importorskip("transformers")
    script = ("import os, torch, transformers, triton\n"
              "os.environ['TRITON_INTERPRET'] = '1'\n"
              "import tigon.functional as TF\n"
              "try:\n"
              "    TF.rms_norm(torch.randn(2, 4), torch.ones(4))\n"
              "except RuntimeError as e:\n"
              "    print('RuntimeError:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert ("RuntimeError: Triton's interpreter was turned on (TRITON_INTERPRET=1) after triton had been imported"
            in out.stdout), out.stderr[-2000:]
    assert "import tigon before transformers and triton" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the switch is for machines without a GPU")
@pytest.mark.parametrize("given", [None, "0", "1"])
def test_importing_tigon_without_a_gpu_turns_the_interpreter_on_unless_the_user_chose(given):
    """No TRITON_INTERPRET and no GPU: importing tigon sets it, and a kernel runs (interpreted)
    in a script that sets nothing. A value the user gave is kept either way."""
    script = ("import os, torch, tigon\n"
              "print('TRITON_INTERPRET', os.environ.get('TRITON_INTERPRET'))\n"
              "x = torch.randn(3, 8, requires_grad=True)\n"
              "y = tigon.functional.rms_norm(x, torch.ones(8))\n"
              "y.sum().backward()\n"
              "ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)\n"
              "print('max error', (y - ref).abs().max().item())\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if given is not None:
        env["TRITON_INTERPRET"] = given
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert f"TRITON_INTERPRET {given or '1'}" in out.stdout, out.stderr[-2000:]
    if given == "0":  # no interpreter, no GPU: the kernel cannot run, and the error says how to run it
        assert out.returncode != 0 and "is on the CPU" in out.stderr and "TRITON_INTERPRET=1" in out.stderr
    else:
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout.split("max error")[1]) < 1e-5


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu", "cross_entropy", "rope"])
def test_float64_is_refused_not_silently_computed_in_float32(op):
    x = torch.randn(4, 8, device=DEVICE, dtype=torch.float64)
    calls = {
        "rms_norm": lambda: TF.rms_norm(x, torch.ones(8, device=DEVICE, dtype=torch.float64)),
        "layer_norm": lambda: TF.layer_norm(x, None, None),
        "swiglu": lambda: TF.swiglu(x, x),
        "cross_entropy": lambda: TF.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=DEVICE)),
        "rope": lambda: TF.apply_rotary_pos_emb(x.view(1, 1, 4, 8), x.view(1, 1, 4, 8), x[None], x[None]),
    }
    with pytest.raises(TypeError, match="float64.*tigon kernels take float32, float16 or bfloat16"):
        calls[op]()


def test_private_apis_switched_off_keep_results_exact():
    """TIGON_PRIVATE_APIS=0: every reach into torch's / Triton's internals falls back to public
    behaviour (tigon.ops._internals); results stay exact: a backward over a retained graph, the
    checkpointed MLP, the tied-embedding gradient."""
    script = """
import os, torch, torch.utils.checkpoint as ckpt
import tigon.functional as TF
from tigon.ops import _internals, glu_mlp
from tigon.ops.embedding import TiedGradSlot
assert not _internals.PRIVATE_APIS and not _internals.fast_launch_enabled()
torch.set_default_device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
w = torch.randn(7, 40, requires_grad=True); h = torch.randn(5, 7); t = torch.randint(0, 40, (5,))
loss = 0.5 * TF.cross_entropy(h @ w, t, inplace=True)
loss.backward(retain_graph=True); loss.backward()
w64 = w.detach().double().requires_grad_()
(0.5 * torch.nn.functional.cross_entropy(h.double() @ w64, t)).backward()
assert torch.allclose(w.grad.double(), 2 * w64.grad, rtol=1e-5, atol=1e-7)
assert not _internals.under_checkpoint()
x = torch.randn(3, 8, requires_grad=True)
lin = [torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False)]
out = ckpt.checkpoint(lambda x: glu_mlp.gated_mlp(x, *lin, "silu"), x, use_reentrant=False)
ref = lin[2](torch.nn.functional.silu(lin[0](x)) * lin[1](x))
assert torch.allclose(out, ref, atol=1e-6)
print("ok")
"""
    env = dict(os.environ, TIGON_PRIVATE_APIS="0")  # TRITON_INTERPRET as in this session (CPU or GPU)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]
