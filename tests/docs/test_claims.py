"""The documentation's claims that follow from the code, checked against it so they cannot drift
(the family counts of README.md and docs/index.md, the supported-models page naming every family)."""

import re
from pathlib import Path

import pytest

from tigon.patching import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
# Where each sentence lives, and the pattern that reads (total, text, vision-language) from it.
COUNT_SENTENCES = {
    "README.md": r"A patcher\*\* for (\d+) Hugging Face model families \((\d+) text, (\d+) vision-language\)",
    "docs/index.md": r"A patcher\*\* for (\d+) Hugging Face model families \((\d+) text, (\d+) vision-language\)",
    "docs/models.md": r"knows (\d+) Hugging Face model families: (\d+) text families .*? and (\d+) vision-language",
}


def _counts():
    text = [name for name, f in FAMILIES.items() if f.causal_lm and not f.conditional_generation]
    return len(FAMILIES), len(text), len(FAMILIES) - len(text)


@pytest.mark.parametrize("page", sorted(COUNT_SENTENCES))
def test_family_counts_match_the_family_table(page):
    pattern = COUNT_SENTENCES[page]
    found = re.search(pattern.replace(" ", r"\s+"), (ROOT / page).read_text(), re.S)
    assert found, f"{page} must have a sentence matching {pattern!r}"
    assert tuple(map(int, found.groups())) == _counts(), page


def test_every_family_is_named_on_the_supported_models_page():
    page = (ROOT / "docs" / "models.md").read_text()
    missing = [name for name, f in FAMILIES.items()
               if not any(re.search(rf"\b{re.escape(n)}\b", page) for n in (name, *f.model_types))]
    assert not missing, f"families docs/models.md does not name: {missing}"
