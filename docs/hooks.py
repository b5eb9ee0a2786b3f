"""mkdocs hooks (mkdocs.yml ``hooks:``) for tigon's documentation.

The pages are written for both places they are read: GitHub, where a link to a file of the
repository outside ``docs/`` is a relative path (``../benchmarks/results/h100/demo/loss_curves.png``,
``../examples/grpo_with_trl.py``), and the built site, which holds only ``docs/``. At build time:

- an image of the repository a page links to (the benchmark plots under ``benchmarks/results/``) is
  added to the site at its repository path, and the link points there: no copy is committed;
- a link to any other repository file or folder points at it on GitHub (``repo_url``);
- a link to a repository path that does not exist is a warning (an error under ``--strict``);
- ``<!-- tigon:patch-functions -->`` becomes the table of ``tigon.patch_<family>`` functions, one
  row per row of ``tigon.patching.families.FAMILIES`` (read from that file: nothing is imported);
- griffe's warning that ``__all__`` holds a non-string (``*PATCHERS``: the ``patch_<family>``
  names, made at import, which static analysis cannot list) is dropped for tigon's packages: those
  names are documented by the table above instead.
"""

from __future__ import annotations

import importlib.util
import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.tigon")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
# A Markdown link or image target: ](target) or ](target "title"); the target has no spaces.
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
PATCH_FUNCTIONS = "<!-- tigon:patch-functions -->"


class _DynamicExportsFilter(logging.Filter):
    """Drops griffe's "Unsupported item in tigon...__all__: PATCHERS" (see the module docstring)."""

    def filter(self, record):
        message = record.getMessage()
        return not ("Unsupported item in tigon" in message and "PATCHERS" in message)


def on_startup(command, dirty):
    logging.getLogger("mkdocs.plugins.griffe").addFilter(_DynamicExportsFilter())


def _repo_root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _outside_target(page_src_uri: str, target: str, docs_dir: Path, root: Path) -> str | None:
    """The repository path (posix, from the root) a relative link of a page leads to when that
    is outside docs_dir; None for links inside it, absolute links and URLs."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("/", "#")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    page_dir = (docs_dir / page_src_uri).parent
    resolved = Path(posixpath.normpath((page_dir / path).as_posix()))
    try:
        resolved.relative_to(docs_dir)
        return None
    except ValueError:
        pass
    try:
        return resolved.relative_to(root).as_posix()
    except ValueError:
        return None


def _markdown_links(text: str):
    """Link targets outside fenced code blocks."""
    inside_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            inside_fence = not inside_fence
            continue
        if not inside_fence:
            for match in LINK.finditer(line):
                yield match.group(2)


def on_files(files, config):
    """Add the repository images the pages link to, at their repository paths."""
    docs_dir, root = Path(config["docs_dir"]).resolve(), _repo_root(config)
    wanted = set()
    for page in files.documentation_pages():
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for target in _markdown_links(text):
            repo_path = _outside_target(page.src_uri, target, docs_dir, root)
            if repo_path and repo_path.lower().endswith(IMAGE_SUFFIXES) and (root / repo_path).is_file():
                wanted.add(repo_path)
    for repo_path in sorted(wanted):
        if files.get_file_from_path(repo_path) is None:
            files.append(File(repo_path, str(root), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir, root = Path(config["docs_dir"]).resolve(), _repo_root(config)
    blob = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match):
        target = match.group(2)
        repo_path = _outside_target(page.file.src_uri, target, docs_dir, root)
        if repo_path is None:
            return match.group(0)
        anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
        where = root / repo_path
        if not where.exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_uri, repo_path)
            return match.group(0)
        if repo_path.lower().endswith(IMAGE_SUFFIXES):
            new = posixpath.relpath(repo_path, posixpath.dirname(page.file.src_uri) or ".")
        else:
            new = f"{blob}/{'tree' if where.is_dir() else 'blob'}/main/{repo_path}{anchor}"
        return match.group(1) + new + match.group(3)

    out, inside_fence = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            inside_fence = not inside_fence
        elif not inside_fence:
            line = LINK.sub(rewrite, line)
        out.append(line)
    markdown = "\n".join(out)
    if PATCH_FUNCTIONS in markdown:
        markdown = markdown.replace(PATCH_FUNCTIONS, _patch_functions_table(root))
    return markdown


def _families(root: Path):
    """tigon.patching.families.FAMILIES, loaded from its file (standard library only)."""
    path = root / "src" / "tigon" / "patching" / "families.py"
    name = "_tigon_docs_families"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module.FAMILIES


def _patch_functions_table(root: Path) -> str:
    rows = ["| function | `config.model_type` | what it patches |", "|---|---|---|"]
    for name, family in _families(root).items():
        kind = "vision-language model" if family.conditional_generation else "causal LM"
        classes = family.conditional_generation or family.causal_lm
        rows.append(f"| <a id=\"tigon.patch_{name}\"></a>`tigon.patch_{name}` | "
                    f"{', '.join(f'`{t}`' for t in family.model_types)} | "
                    f"{kind}: `{family.module}` (`{classes}`) |")
    return "\n".join(rows)
