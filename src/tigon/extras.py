"""The optional extras (``pip install "tigon[demo]"``) and the one-line error when one is missing.

The extras and their packages are pyproject.toml's ``[project.optional-dependencies]``: read here
from the installed package's metadata (``Requires-Dist: trl>=1.0; extra == "trl"``), or from the
source tree's pyproject.toml when tigon runs uninstalled (``PYTHONPATH=src``), so that file stays
the one owner. Nothing here imports the rest of tigon.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata
from pathlib import Path

# A requirement's distribution name (and its extras): "tigon[hf]", "mkdocstrings[python]>=0.26".
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


class MissingExtra(ImportError):
    """What a command or function needs is not installed; the message names the extra to install."""

    def __init__(self, needed_by: str, extra: str, missing: list[str]):
        self.extra, self.missing = extra, missing
        super().__init__(f"{needed_by} needs {', '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed: pip install \"tigon[{extra}]\"")


@functools.cache
def extras() -> dict[str, tuple[str, ...]]:
    """{extra: the distributions it installs, extras of tigon's own expanded}, from the installed
    tigon's metadata or the source tree's pyproject.toml; {} when neither can be read."""
    try:
        requires = metadata.requires("tigon") or []
    except metadata.PackageNotFoundError:
        requires = _source_tree_requirements()
    direct: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for requirement in requires:
        marker = _EXTRA_MARKER.search(requirement)
        name = _REQUIREMENT.match(requirement)
        if marker and name:
            inner = tuple(e.strip() for e in (name.group(2) or "").split(",") if e.strip())
            direct.setdefault(marker.group(1), []).append((name.group(1), inner))

    def expand(extra: str, seen: frozenset) -> list[str]:
        out = []
        for dist, inner in direct.get(extra, []):
            if _normal(dist) == "tigon":
                for sub in inner:
                    if sub not in seen:
                        out += expand(sub, seen | {sub})
            elif dist not in out:
                out.append(dist)
        return list(dict.fromkeys(out))

    return {extra: tuple(expand(extra, frozenset({extra}))) for extra in direct}


def _source_tree_requirements() -> list[str]:
    """pyproject.toml's optional dependencies as metadata lines (``dist; extra == "name"``)."""
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib  # Python 3.11+

        optional = tomllib.loads(path.read_text())["project"]["optional-dependencies"]
    except (ImportError, OSError, KeyError):
        return []
    return [f'{dist}; extra == "{extra}"' for extra, dists in optional.items() for dist in dists]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``; None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _installed(dist: str) -> bool:
    return installed_version(dist) is not None


def missing_from(extra: str) -> list[str]:
    """The distributions of ``extra`` that are not installed ([] when tigon's metadata is absent)."""
    known = extras()
    if known and extra not in known:
        raise ValueError(f"extra must be one of {sorted(known)}, got {extra!r}")
    return [dist for dist in known.get(extra, ()) if not _installed(dist)]


def require_extra(extra: str, needed_by: str) -> None:
    """Raise MissingExtra naming ``extra`` when any of its distributions is not installed."""
    missing = missing_from(extra)
    if missing:
        raise MissingExtra(needed_by, extra, missing)
