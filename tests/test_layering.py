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
    {"_checks", "_io", "_runtime", "_native"},
    {"_native_train"},
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


# Deprecated aliases, kept for one release: each forwards an old import path to its new home, lazily and with a
# DeprecationWarning. They are the only files the order does not bind (test_deprecated_aliases_warn checks them).
DEPRECATED_ALIASES = {
    "functional/attention.py": "attnlab.functional.attention -> attnlab.backends.dispatch / functional.request",
    "attention/__init__.py": "attnlab.attention.* (the package of modules) -> attnlab.modules.*",
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


def import_graph(root: Path, skip: frozenset = frozenset()) -> dict[tuple[str, str], list[str]]:
    """``{(importer, imported): ["file:line", ...]}`` between the units under ``root`` (a package folder),
    leaving out the files named (relative to ``root``) in ``skip``."""
    package = root.name
    files = sorted(p for p in root.rglob("*.py") if p.relative_to(root).as_posix() not in skip)
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
    return import_graph(ROOT, frozenset(DEPRECATED_ALIASES))


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


def test_deprecated_aliases_warn():
    """Each skipped file is a real alias: its old names resolve, with a DeprecationWarning."""
    import importlib

    module = importlib.import_module("attnlab.functional.attention")
    for name in module._MOVED:
        with pytest.warns(DeprecationWarning, match="moved to"):
            assert getattr(module, name) is not None
    assert set(DEPRECATED_ALIASES) == {"functional/attention.py", "attention/__init__.py"}


def test_the_old_package_of_modules_still_imports_with_a_warning_and_the_function_stays_callable():
    """A fresh interpreter: ``import attnlab.attention.multihead`` warns once, gives the moved module, and
    ``attnlab.attention(q, k, v)`` is still the pipeline afterwards (the import rebinds the name)."""
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import attnlab.attention.multihead as old\n"
        "    from attnlab.attention import MultiheadAttention\n"
        "import attnlab, attnlab.modules.multihead as new\n"
        "assert old is new and MultiheadAttention is new.MultiheadAttention\n"
        "assert [str(x.message) for x in w if issubclass(x.category, DeprecationWarning)], 'no warning'\n"
        "q = torch.randn(1, 2, 5, 4)\n"
        "out = attnlab.attention(q, q, q, causal=True)\n"
        "assert torch.allclose(out, attnlab.backends.dispatch.attention(q, q, q, causal=True))\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


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
