"""Every ```python block of docs/**/*.md and README.md runs, on the CPU interpreter here.

A page's blocks run in order in one namespace (a later block may use what an earlier one made), in
a temporary working folder, with ``examples/`` on the import path (the TRL guide imports the
trainers of ``examples/*_with_trl.py`` as a user who copied them would). No network is used, so:

- ``transformers.AutoModelForCausalLM.from_pretrained(hub_id, ...)`` (and so
  ``tigon.AutoModelForCausalLM.from_pretrained``) builds a tiny random model of the hub id's
  family from its config instead (``TINY_FAMILIES`` maps the ids the pages use to a family);
  ``AutoTokenizer.from_pretrained`` gives a small word-level tokenizer;
- ``torch.compile`` without a ``backend`` uses ``"aot_eager"`` unless the kernels run compiled on a
  GPU (dynamo and AOTAutograd trace as for Inductor; Inductor's own code generation for the CPU
  or Triton's interpreter is not what the pages are about and would take minutes).

A block must run on a CUDA machine as on a CPU-only one: what it builds goes on the GPU when
there is one (``device = "cuda" if torch.cuda.is_available() else "cpu"``, or ``model.device``
after a trainer placed the model), as a user's code would.

A block that cannot run here is marked in the Markdown, on the line before it:
``<!-- snippet: skip <reason>: <why> -->`` (the reason is one of ``SKIP_REASONS``: it needs a CUDA
GPU, several processes, DeepSpeed, a download; ``gpu`` blocks run when the kernels run on a GPU,
``pytest --gpu``), or ``<!-- snippet: requires <module> -->`` (runs when the module imports, else
skipped). Each skipped block is still compiled (a syntax check) and
reported as a skipped test with its reason. An unmarked block must run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SKIP_REASONS = {
    "gpu": "needs a CUDA GPU",
    "distributed": "needs several processes (torchrun)",
    "deepspeed": "needs DeepSpeed and several processes",
    "download": "downloads a model or data set",
}
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(skip|requires)\s+([A-Za-z0-9_.]+)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([A-Za-z0-9_+-]*)")

# Hub ids the pages load, by the family of the tiny model built for them.
TINY_FAMILIES = {
    "meta-llama/": "llama",
    "Qwen/Qwen2.5": "qwen2",
    "Qwen/Qwen3": "qwen3",
    "google/gemma-2": "gemma2",
    "mistralai/": "mistral",
}


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None = None  # why it does not run here, or None


def blocks_of(path: Path, page: str | None = None) -> list[Block]:
    """The page's ```python blocks, with their markers (a marker must come right before a block)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = page or path.relative_to(ROOT).as_posix()
    out, marker, i = [], None, 0
    while i < len(lines):
        found = MARKER.match(lines[i])
        if found:
            if marker:
                raise ValueError(f"{page}:{marker[2]}: a snippet marker with no ```python block after it")
            marker = (found.group(1), found.group(2), i + 1, found.group(3))
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if not fence:
            if marker and lines[i].strip():
                raise ValueError(f"{page}:{marker[2]}: a snippet marker must be right before a ```python block")
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        if lang != "python":
            if marker:
                raise ValueError(f"{page}:{marker[2]}: a snippet marker before a {lang or 'plain'} block")
            continue
        out.append(Block(page, start + 1, "\n".join(body) + "\n", _skip_reason(page, marker)))
        marker = None
    if marker:
        raise ValueError(f"{page}:{marker[2]}: a snippet marker with no ```python block after it")
    return out


def _skip_reason(page: str, marker) -> str | None:
    if marker is None:
        return None
    kind, word, line, why = marker
    if kind == "skip":
        if word not in SKIP_REASONS:
            raise ValueError(f"{page}:{line}: skip reason {word!r} is not one of {sorted(SKIP_REASONS)}")
        if word == "gpu" and _on_gpu():
            return None
        return f"{word}: {why or SKIP_REASONS[word]}"
    if importlib.util.find_spec(word) is None:
        return f"requires {word}, which is not installed"
    return None


def _on_gpu() -> bool:
    """Whether the kernels run compiled on a CUDA GPU here (then ``skip gpu`` blocks run too)."""
    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0"


BLOCKS = {path.relative_to(ROOT).as_posix(): blocks_of(path) for path in PAGES}
RUNNABLE = [page for page, blocks in BLOCKS.items() if any(b.skip is None for b in blocks)]
SKIPPED = [b for blocks in BLOCKS.values() for b in blocks if b.skip is not None]


def test_every_page_parses_and_every_block_compiles():
    for blocks in BLOCKS.values():
        for b in blocks:
            compile(b.code, f"{b.page}:{b.line}", "exec")


@pytest.mark.parametrize("block", SKIPPED, ids=[f"{b.page}:{b.line}" for b in SKIPPED])
def test_marked_block(block):
    pytest.skip(f"{block.page}:{block.line}: {block.skip}")


# ---- what stands in for the network ----

def _tiny_model_config(name: str, **overrides):
    from transformers import AutoConfig

    family = next((f for prefix, f in TINY_FAMILIES.items() if str(name).startswith(prefix)), None)
    if family is None:
        raise ValueError(f"the snippet test has no tiny model for {name!r}: add its family to TINY_FAMILIES")
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                 bos_token_id=None)
    if family in ("qwen2", "qwen3"):
        sizes.update(tie_word_embeddings=True)
    if family in ("qwen3", "gemma2"):
        sizes.update(head_dim=16)
    return AutoConfig.for_model(family, **{**sizes, **overrides})


def _tiny_from_pretrained(cls, name, *args, **kwargs):
    from transformers import AutoModelForCausalLM

    keep = {k: v for k, v in kwargs.items() if k in ("dtype", "torch_dtype", "attn_implementation")}
    return AutoModelForCausalLM.from_config(_tiny_model_config(name), **keep)


WORDS = ("the a cat dog sat ran on to in mat park is was good bad yes no and of it this that "
         "what why how one two three red blue big small hello world answer question").split()


def _tiny_tokenizer(cls, name, *args, **kwargs):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side=kwargs.get("padding_side", "right"))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The stand-ins of the module docstring, a temporary working folder and examples/ on the path."""
    import torch
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(_tiny_from_pretrained))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(_tiny_tokenizer))
    compile_ = torch.compile

    def compile_off_gpu(*args, **kwargs):
        if "backend" not in kwargs and not _on_gpu():
            kwargs["backend"] = "aot_eager"
        return compile_(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_off_gpu)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    yield


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_snippets_run(page, offline):
    import torch

    import tigon

    namespace = {"__name__": "__snippet__"}
    torch.manual_seed(0)
    try:
        for block in BLOCKS[page]:
            if block.skip is None:
                exec(compile(block.code, f"{page}:{block.line}", "exec"), namespace)
    except ModuleNotFoundError as exc:  # an extra's package this machine lacks (the GPU machine: datasets)
        missing = (exc.name or "").partition(".")[0]
        if missing and missing != "tigon" and importlib.util.find_spec(missing) is None:
            pytest.skip(f"{page} needs {missing}, which is not installed here")
        raise
    finally:
        tigon.unpatch()
        torch._dynamo.reset()
        sys.modules.pop("grpo_with_trl", None)
        sys.modules.pop("dpo_with_trl", None)


def test_markers_are_checked(tmp_path, monkeypatch):
    """A marker's mistakes are errors, not silent skips; a good one skips with its reason."""
    monkeypatch.setattr(sys.modules[__name__], "_on_gpu", lambda: False)
    path = tmp_path / "page.md"
    cases = {"<!-- snippet: skip cloud: no -->\n```python\nx = 1\n```\n": "skip reason 'cloud'",
             "<!-- snippet: skip gpu -->\n\ntext\n```python\nx = 1\n```\n": "right before",
             "<!-- snippet: skip gpu -->\n```bash\nls\n```\n": "before a bash block",
             "text\n<!-- snippet: skip gpu -->\n": "no ```python block after it"}
    for text, error in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(error)):
            blocks_of(path, "page.md")
    path.write_text("<!-- snippet: skip gpu: CUDA graphs -->\n\n```python\nx = 1\n```\n```python\ny = 2\n```\n")
    assert [b.skip for b in blocks_of(path, "page.md")] == ["gpu: CUDA graphs", None]
