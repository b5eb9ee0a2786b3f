"""Every public name has a docstring and is rendered by an API reference page (docs/reference/).

The public names: ``__all__`` of ``tigon``, ``tigon.nn``, ``tigon.losses``, ``tigon.planning`` and
``tigon.ops``; the functions and classes defined in ``tigon.functional`` and ``tigon.torchtune``
(modules without ``__all__``); and ``EXTRA``. The site is built (``mkdocs build``, not strict:
``mkdocs build --strict`` in CI checks the links) and a name counts as rendered when some heading
or anchor id of a reference page names it or the object it is, e.g. ``tigon.patch`` rendered as
``tigon.api.patch``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WITH_ALL = ("tigon", "tigon.nn", "tigon.losses", "tigon.planning", "tigon.ops")
DEFINED_IN = ("tigon.functional", "tigon.torchtune")
EXTRA = ("tigon.extras.MissingExtra",)
VALUES = (str, int, float, bool, dict, tuple, list, frozenset)  # documented in prose, no docstring of their own


def public_names() -> dict[str, object]:
    names = {}
    for module_name in WITH_ALL:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            names[f"{module_name}.{name}"] = getattr(module, name)
    for module_name in DEFINED_IN:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if not name.startswith("_") and getattr(obj, "__module__", None) == module_name \
                    and (inspect.isfunction(obj) or inspect.isclass(obj)):
                names[f"{module_name}.{name}"] = obj
    for path in EXTRA:
        module_name, name = path.rsplit(".", 1)
        names[path] = getattr(importlib.import_module(module_name), name)
    return names


def docstring(obj) -> str | None:
    from tigon.ops._common import TigonOp

    if isinstance(obj, TigonOp):
        return obj._body.__doc__  # the op's own body; the instance's __doc__ is TigonOp's
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        # a dataclass without a docstring gets its signature as __doc__
        return None if not doc or doc.startswith(f"{obj.__name__}(") else doc
    return getattr(obj, "__doc__", None)


def resolve(path: str):
    """The object a dotted path names (a module, then attributes), or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> set[int]:
    """id() of every object a reference page renders."""
    for needed in ("mkdocs", "mkdocstrings", "material"):
        pytest.importorskip(needed)
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                   check=True, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    ids = set()
    for page in (site / "reference").rglob("*.html"):
        ids |= set(re.findall(r'id="(tigon(?:\.\w+)*)"', page.read_text(encoding="utf-8")))
    assert ids, "the reference pages render nothing"
    return {id(obj) for obj in map(resolve, ids) if obj is not None}


PUBLIC = public_names()


def test_every_public_name_has_a_docstring():
    assert len(PUBLIC) > 150, sorted(PUBLIC)  # the walk found the packages' names
    missing = sorted(path for path, obj in PUBLIC.items()
                     if not isinstance(obj, VALUES) and not (docstring(obj) or "").strip())
    assert not missing, f"public names without a docstring (add one, short, with shapes and dtypes): {missing}"


def test_every_public_name_is_rendered(rendered):
    missing = sorted(path for path, obj in PUBLIC.items() if id(obj) not in rendered)
    assert not missing, f"no page of docs/reference/ renders these public names: {missing}"
