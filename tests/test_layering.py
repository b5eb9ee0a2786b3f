"""The import graph of src/tigon: no cycle, and no module importing from a layer above its own
(function-local imports included). Read from the source with ast; nothing is imported."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module may import its own layer and the layers below; a name matches its
# package and everything under it (the longest listed prefix decides).
LAYERS = (
    ("tigon.ambient", "tigon.sizes", "tigon.shapes", "tigon.reference", "tigon.extras"),
    ("tigon.ops",),
    ("tigon.functional", "tigon.nn"),
    ("tigon.losses",),
    ("tigon.hf_model", "tigon.patching", "tigon.tiny_models"),
    ("tigon.planning",),
    ("tigon.api", "tigon.auto", "tigon.torchtune", "tigon.torchtune_recipe", "tigon.compat"),
    ("tigon.bench", "tigon.demo", "tigon.doctor", "tigon.cli", "tigon"),
)


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "tigon").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known) -> set[str]:
    """The tigon modules ``name`` imports: ``from pkg import sub`` counts as pkg.sub when that is
    a module, else as pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def layer_of(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    assert best is not None, f"{name} is in no layer of LAYERS: add it"
    return best[0]


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_is_in_a_layer():
    for name in graph():
        layer_of(name)


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})"
              for name, deps in graph().items() for dep in sorted(deps) if layer_of(dep) > layer_of(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    done, cycles = set(), []

    def visit(node, path):
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for dep in sorted(edges[node]):
            visit(dep, path + [node])
        done.add(node)

    for name in sorted(edges):
        visit(name, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The walk finds what it is for: a package whose two modules import each other, one of them
    from a higher layer."""
    package = tmp_path / "tigon"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ops" / "__init__.py").write_text("from tigon.ops import a\n")
    (package / "ops" / "a.py").write_text("def f():\n    from tigon import api\n")
    (package / "api.py").write_text("from tigon.ops import a\n")
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        edges = graph()
        assert edges["tigon.ops.a"] == {"tigon.api"} and "tigon.ops.a" in edges["tigon.api"]
        upward = _failure(test_no_module_imports_from_a_higher_layer)
        assert "tigon.ops.a (layer 1) imports tigon.api (layer 6)" in upward
        assert "tigon.api -> tigon.ops.a -> tigon.api" in _failure(test_no_import_cycle)
    finally:
        SRC = saved


def _failure(check) -> str:
    """The message ``check()`` fails with (it must fail)."""
    try:
        check()
    except AssertionError as e:
        return str(e)
    raise AssertionError(f"{check.__name__} passed on a tree that breaks it")
