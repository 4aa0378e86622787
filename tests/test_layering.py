"""Lower layers never import higher ones (docs/architecture.md, "Layout and which package may import which").

The import graph between attnlab's subpackages (and top-level modules) is read from the source with
``ast``: every ``import`` / ``from ... import`` anywhere in a file, at the top or inside a function,
absolute or relative. An arrow ``A -> B`` is allowed when B's layer is strictly below A's. The
arrows that still go the wrong way are listed in ``KNOWN_BACKWARD`` with the reason; the list may
only shrink: a listed arrow that no longer exists fails too, so that it gets removed.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attnlab

ROOT = Path(attnlab.__file__).parent

# Lowest first; a unit may import only units of a strictly lower layer. Keep in step with the docs.
LAYERS: list[set[str]] = [
    {"_native_library"},  # what torch.library knows of the C++ ops (imports torch only; _native registers it)
    {"_checks"},
    {"_io", "_limits", "_runtime", "_native"},
    {"_native_train", "_choice"},
    {"functional"},
    {"backends"},
    {"modules"},
    {"nn"},
    {"models"},
    {"generation"},
    {"data"},
    {"adapt", "evaluation", "viz"},
    {"training"},
    {"experiments"},
    {"cli", "bench", "env_cli", "generate_cli"},
    {"__main__"},  # `python -m attnlab`
]
FACADE = "__init__"  # attnlab/__init__.py re-exports the public API from every layer

KNOWN_BACKWARD = {
    ("models", "generation"): "models expose .generate(), a thin method that imports generation lazily",
}


def _unit(path: Path, root: Path) -> str:
    """The unit a file belongs to: its top-level subpackage, or the top-level module's name."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else path.stem


def _imported_units(node: ast.AST, module: list[str], units: set[str], package: str) -> list[str]:
    """The units an import statement names; ``module`` is the importing file's package path (dotted parts)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            base = ".".join(module[:len(module) - node.level + 1] + ([base] if base else []))
        # `from attnlab import nn` names a unit through the imported name
        names = [f"{base}.{a.name}" for a in node.names] if base == package else [base]
    else:
        return []
    found = []
    for name in names:
        parts = name.split(".")
        if parts[0] == package and len(parts) > 1 and parts[1] in units:
            found.append(parts[1])
    return found


def import_graph(root: Path) -> dict[tuple[str, str], list[str]]:
    """``{(importer, imported): ["file:line", ...]}`` between the units under ``root`` (a package folder)."""
    package = root.name
    files = sorted(root.rglob("*.py"))
    units = {_unit(p, root) for p in files}
    graph: dict[tuple[str, str], list[str]] = {}
    for path in files:
        src = _unit(path, root)
        rel = path.relative_to(root.parent).with_suffix("").parts
        module = list(rel[:-1])  # the package the file is in (for relative imports)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for dst in _imported_units(node, module, units, package):
                if dst != src:
                    graph.setdefault((src, dst), []).append(f"{path.relative_to(root)}:{node.lineno}")
    return graph


def backward_arrows(graph, layers: list[set[str]], facade: str = FACADE) -> dict[tuple[str, str], list[str]]:
    """The arrows of ``graph`` whose target is not in a strictly lower layer than its source (a unit
    missing from ``layers`` is an error: every unit must have its place)."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    bad = {}
    for (src, dst), where in graph.items():
        if src == facade:
            continue
        for u in (src, dst):
            if u not in rank:
                raise AssertionError(f"{u!r} has no layer: add it to LAYERS (and to docs/architecture.md)")
        if rank[dst] >= rank[src]:
            bad[(src, dst)] = where
    return bad


def _graph():
    return import_graph(ROOT)


def test_no_new_backward_import():
    bad = backward_arrows(_graph(), LAYERS)
    new = {k: v for k, v in bad.items() if k not in KNOWN_BACKWARD}
    assert not new, "imports against the layer order: " + "; ".join(
        f"{a} -> {b} at {', '.join(w[:3])}" for (a, b), w in sorted(new.items()))


def test_known_backward_arrows_still_exist():
    """A folded arrow must leave KNOWN_BACKWARD (and the docs' table), so the list only shrinks."""
    bad = backward_arrows(_graph(), LAYERS)
    gone = sorted(set(KNOWN_BACKWARD) - set(bad))
    assert not gone, f"these arrows are gone, remove them from KNOWN_BACKWARD and the docs: {gone}"


def test_the_folded_arrows_stay_folded():
    graph = _graph()
    for arrow in [("functional", "backends"), ("backends", "nn"), ("modules", "nn"), ("evaluation", "training"), ("adapt", "cli"),
                  ("evaluation", "cli"), ("viz", "cli"), ("experiments", "cli")]:
        assert arrow not in graph, (arrow, graph.get(arrow))


def test_attnlab_attention_is_only_the_function():
    """The old paths of the modules (``attnlab.attention.*``, a package that shadowed the function) and of the
    pipeline (``attnlab.functional.attention``) are gone: the modules are in ``attnlab.modules``."""
    import importlib

    for old in ("attnlab.attention.multihead", "attnlab.functional.attention"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    assert callable(attnlab.attention) and attnlab.attention is attnlab.backends.dispatch.attention


def test_no_two_modules_import_each_other():
    """Within a unit too, imports go one way: of two modules (not packages), at most one imports the other, even
    for type annotations only (a module's ``__init__`` and its submodules are exempt)."""
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p
               for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    imports = {}
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0].split(".")
        named = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                named |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                    else node.module
                named |= {base.rstrip(".")} | {f"{base.rstrip('.')}.{a.name}" for a in node.names}
        imports[name] = named & set(modules)
    both = sorted({tuple(sorted((a, b))) for a in imports for b in imports[a] if a in imports[b]})
    assert not both, f"modules that import each other: {both}"


def test_the_docs_state_the_same_order():
    """docs/architecture.md states the same layers, in the same order, as LAYERS."""
    doc = (ROOT.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = doc.index("Layer order (lowest first):")
    order = doc[start:doc.index(".", start)]  # the sentence, over its line breaks
    groups = [{u.strip("`") for u in g.split()} for g in order.split(":", 1)[1].split("→")]
    assert groups == [layer for layer in LAYERS if layer != {"__main__"}]


# --------------------------------------------------------------- the rule on a made-up package

def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fakepkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


FAKE_LAYERS = [{"low"}, {"mid"}, {"high", "tool"}]


def test_rule_accepts_downward_imports(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "from fakepkg.high import thing\n",  # the facade may import anything
        "low/__init__.py": "",
        "mid/__init__.py": "from fakepkg.low import a\n",
        "high/__init__.py": "from ..mid import b\nimport fakepkg.low.c\n",
        "tool.py": "from fakepkg import low\n",
    })
    graph = import_graph(root)
    assert set(graph) == {("__init__", "high"), ("mid", "low"), ("high", "mid"), ("high", "low"), ("tool", "low")}
    assert backward_arrows(graph, FAKE_LAYERS) == {}


def test_rule_catches_a_backward_import_anywhere(tmp_path):
    """Top-level, lazy (inside a function), relative and `from pkg import unit` forms are all seen,
    and so is an import between two units of the same layer."""
    root = _fake_package(tmp_path, {
        "low/__init__.py": "",
        "low/lazy.py": "def f():\n    from fakepkg.mid import x\n    return x\n",
        "mid/__init__.py": "from ..high import y\n",
        "high/__init__.py": "from fakepkg import tool\n",
        "tool.py": "",
    })
    bad = backward_arrows(import_graph(root), FAKE_LAYERS)
    assert bad == {("low", "mid"): ["low/lazy.py:2"], ("mid", "high"): ["mid/__init__.py:1"],
                   ("high", "tool"): ["high/__init__.py:1"]}


def test_rule_refuses_a_unit_without_a_layer(tmp_path):
    root = _fake_package(tmp_path, {"low/__init__.py": "", "stray.py": "import fakepkg.low\n"})
    with pytest.raises(AssertionError, match="'stray' has no layer"):
        backward_arrows(import_graph(root), FAKE_LAYERS)
