"""The README's claims that follow from the code, checked against it so they cannot drift."""

import re
from pathlib import Path

from tigon.patching import FAMILIES

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_family_counts_match_the_family_table():
    text = [name for name, f in FAMILIES.items() if f.causal_lm and not f.conditional_generation]
    pattern = r"A patcher\*\* for (\d+) Hugging Face model families \((\d+) text, (\d+) vision-language\)"
    found = re.search(pattern.replace(" ", r"\s+"), README)
    assert found, f"the README's feature list must match {pattern!r}"
    total, n_text, n_vision = map(int, found.groups())
    assert (total, n_text, n_vision) == (len(FAMILIES), len(text), len(FAMILIES) - len(text))


def test_every_family_is_named_in_the_readme():
    missing = [name for name, f in FAMILIES.items()
               if not any(re.search(rf"\b{re.escape(n)}\b", README) for n in (name, *f.model_types))]
    assert not missing, f"families the README does not name: {missing}"
