"""Layout rules read from the source: no import cycle between rlcd modules, every import along the layers that
docs/ARCHITECTURE.md lists, typer only in rlcd/cli/.

Every import counts, also one inside a function: a lazy import against the pipeline's direction is
still a design cycle (it only hides from the interpreter).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "rlcd").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """rlcd modules `name` imports (the module itself, or the package for `from pkg import x`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in known else mod)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_scanner_sees_imports():
    g = _graph()
    assert "rlcd.run" in g["rlcd.train.setup"] and "rlcd.model.build" in g["rlcd.export"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_no_import_cycles():
    g = _graph()
    # a package's __init__ re-exporting its own modules is not a cycle of the design
    for pkg in [m for m in g if (SRC / m.replace(".", "/") / "__init__.py").is_file()]:
        for child in list(g[pkg]):
            if child.startswith(pkg + "."):
                g[pkg].discard(child)
    assert _cycles(g) == []


def test_typer_lives_in_the_cli_package_only():
    offenders = []
    for name, path in _modules().items():
        if name == "rlcd.cli" or name.startswith("rlcd.cli."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "typer" or n.startswith("typer.") for n in names):
                offenders.append(name)
    assert offenders == []


ARCHITECTURE = SRC.parent / "docs" / "ARCHITECTURE.md"


def documented_layers() -> list[list[str]]:
    """The layer list of docs/ARCHITECTURE.md ("Layers", top to bottom): the one code span after its heading."""
    import re

    text = ARCHITECTURE.read_text(encoding="utf-8")
    rule = text[text.index("- **Layers**"):]
    span = re.search(r"`(cli \|[^`]*)`", rule)
    assert span, "docs/ARCHITECTURE.md: the Layers rule holds no `cli | ...` list"
    return [[name.strip() for name in layer.split(",")] for layer in " ".join(span.group(1).split()).split("|")]


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_top_level_module_is_in_one_documented_layer():
    layers = documented_layers()
    placed = [name for layer in layers for name in layer]
    assert len(placed) == len(set(placed)), "a module is named in two layers"
    tops = {_top(m) for m in _modules()} - {""}
    assert sorted(tops - set(placed)) == [], "top-level modules missing from docs/ARCHITECTURE.md's layers"
    assert sorted(set(placed) - tops) == [], "docs/ARCHITECTURE.md's layers name modules that do not exist"


def test_imports_follow_the_documented_layers():
    layers = documented_layers()
    height = {name: len(layers) - i for i, layer in enumerate(layers) for name in layer}
    against = sorted(f"{a} imports {b}" for a, deps in _graph().items() for b in deps
                     if _top(a) and _top(b) and height.get(_top(b), 0) > height.get(_top(a), 0))
    assert against == []


def test_the_layer_check_can_fail():
    layers = documented_layers()
    height = {name: len(layers) - i for i, layer in enumerate(layers) for name in layer}
    assert height["serving"] < height["model"] < height["cli"]  # so serving importing model is reported
    assert height["errors"] == 1 and height["cli"] == len(layers)
