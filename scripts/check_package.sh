#!/usr/bin/env bash
# The package as a user gets it: build the wheel and the sdist, install each into a fresh venv
# with no extras, and check that the base commands work there and that every command needing an
# extra says in one line which one; then each extra in a venv of its own, with its commands.
#
#   bash scripts/check_package.sh [WORK_DIR]      (CI: .ci/run; about 3 minutes on 2 cores)
#
# torch, triton and numpy are installed once into a "core" venv that the others see through a
# .pth file, so each venv holds only tigon and its extra (torch==2.13.0: the local CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=${1:-$(mktemp -d "${TMPDIR:-/tmp}/tigon-package.XXXXXX")}
mkdir -p "$work"
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor
step() { echo "== $*"; }
fail() { echo "check_package: $*" >&2; exit 1; }
pip_in() {  # pip_in VENV ARGS...: quiet, without the local index's "is ignored" warnings
    "$work/$1/bin/pip" install -q "${@:2}" 2> >(grep -v "is ignored: it is neither" >&2)
}

step "build: wheel and sdist"
rm -rf "$work/dist"
python3 -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; fail "python -m build failed"; }
wheel=$(ls "$work"/dist/tigon-*.whl)
sdist=$(ls "$work"/dist/tigon-*.tar.gz)
echo "$(basename "$wheel") $(basename "$sdist")"
# What the wheel must and must not hold.
python3 - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["tigon/__init__.py", "tigon/cli.py", "tigon/__main__.py", "tigon/py.typed", "tigon/demo_data/tiny_shakespeare.txt.gz"]
missing = [n for n in need if n not in names]
licenses = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
stray = sorted({n.split("/")[0] for n in names} - {"tigon"} - {n.split("/")[0] for n in names if ".dist-info/" in n})
assert not missing, f"the wheel lacks {missing}"
assert licenses, "the wheel has no LICENSE in its .dist-info"
assert not stray, f"the wheel installs top-level names other than tigon: {stray}"
print(f"wheel: {len(names)} files, tigon only, LICENSE and py.typed in")
EOF

step "core venv: torch, triton, numpy"
python3 -m venv "$work/core"
pip_in core torch==2.13.0 numpy triton
core_site=$("$work/core/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

venv() {  # venv NAME: a fresh venv that sees the core's packages and nothing else
    python3 -m venv "$work/$1"
    "$work/$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" | \
        xargs -I{} sh -c "echo '$core_site' > {}/tigon_core.pth"
}
expect_extra() {  # expect_extra VENV EXTRA COMMAND...: exits 1 naming tigon[EXTRA] (a command: in one line)
    local v=$1 extra=$2; shift 2
    local out rc=0
    out=$(cd "$work" && "$work/$v/bin/$@" 2>&1) || rc=$?
    [ "$rc" = 1 ] || fail "$v: '$*' exited $rc, expected 1 (missing extra): $out"
    if [ "$1" != python ]; then  # a library call ends in a traceback whose last line says it
        [ "$(printf '%s\n' "$out" | wc -l)" = 1 ] || fail "$v: '$*' printed more than one line: $out"
    fi
    out=$(printf '%s\n' "$out" | tail -1)
    printf '%s\n' "$out" | grep -qF "pip install \"tigon[$extra]\"" || fail "$v: '$*' did not name tigon[$extra]: $out"
    echo "$v: $* -> $out"
}
one_op='
import torch, tigon
x = torch.randn(5, 24, dtype=torch.float64)
w = torch.rand(24, dtype=torch.float64) + 0.5
xt, wt = x.float().requires_grad_(), w.float().requires_grad_()
y = tigon.functional.rms_norm(xt, wt, eps=1e-6)
y.square().sum().backward()
x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
ref = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
ref.square().sum().backward()
for name, a, b in (("y", y, ref), ("dx", xt.grad, x64.grad), ("dw", wt.grad, w64.grad)):
    err = (a.double() - b).abs().max().item()
    assert err < 1e-4, (name, err)
import os; assert os.environ["TRITON_INTERPRET"] == "1"
print("one op in the interpreter: rms_norm forward and backward match float64")
'

for form in wheel sdist; do
    step "$form, no extras"
    venv "$form"
    pkg=$([ "$form" = wheel ] && echo "$wheel" || echo "$sdist")
    pip_in "$form" "$pkg"
    (cd "$work" && "$work/$form/bin/tigon" --version && "$work/$form/bin/python" -m tigon --version)
    (cd "$work" && "$work/$form/bin/tigon" env | grep -E "^(tigon|torch|triton|kernels) ")
    (cd "$work" && "$work/$form/bin/python" -c "$one_op")
    if [ "$form" = wheel ]; then
        expect_extra wheel demo tigon demo --quick
        expect_extra wheel hf tigon plan llama-1b --seq 64
        expect_extra wheel hf python -c "import tigon; tigon.AutoModelForCausalLM.from_config(None)"
    fi
done

step "extra hf: tigon plan, and patching a built HF model"
venv hf
pip_in hf "$wheel[hf]"
(cd "$work" && "$work/hf/bin/tigon" plan llama-1b --seq 64 --batch 1 | tail -2)
(cd "$work" && "$work/hf/bin/python" - <<'EOF'
import torch, tigon
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 128, (2, 16))
ref = model(input_ids=ids, labels=ids).loss.item()
report = tigon.patch(model)
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
assert abs(loss.item() - ref) < 1e-4, (loss.item(), ref)
assert report.replaced, report
print(f"patched a tiny Llama ({', '.join(sorted(report.pieces()))}); loss {loss.item():.5f} = HF's {ref:.5f}")
EOF
)
expect_extra hf demo tigon demo --quick

step "extra demo: tigon demo (one step a model)"
venv demo
pip_in demo "$wheel[demo]"
(cd "$work" && "$work/demo/bin/tigon" demo --quick --steps 1 --no-progress --out "$work/demo_out" | tail -3)
[ -f "$work/demo_out/loss_curves.png" ] || fail "demo wrote no loss_curves.png"

step "extra trl: examples/dpo_with_trl.py"
venv trl
pip_in trl "$wheel[trl]"
(cd "$work" && "$work/trl/bin/python" "$repo/examples/dpo_with_trl.py" 2>/dev/null | grep "DPO loss")

step "extra docs: mkdocs build --strict"
venv docs
pip_in docs "$wheel[docs]"
"$work/docs/bin/mkdocs" build --strict --quiet -f "$repo/mkdocs.yml" -d "$work/site"
[ -f "$work/site/index.html" ] || fail "mkdocs wrote no index.html"
echo "docs built: $(find "$work/site" -name '*.html' | wc -l) pages"

echo "check_package: all passed"
