#!/usr/bin/env python3
"""Fail on import cycles among restopo's own modules and on imports that point up a layer.

    python tools/check_imports.py      # exit status 1 and one line per problem

Reads every module as pyproject.toml lays the package out (restopo/, and backends/ and
grammars/, which install as restopo.backends and restopo.grammars) and collects its
`import` statements, at module level and inside functions alike, relative ones resolved.
Looking a module up by name at run time (importlib, the backend registry's entry points,
the CLI's command table) is not an import here: it is how lower code reaches higher code.

  cycles  each strongly connected group of two or more modules, with one cycle through it
  layers  a module imports only its own layer and the layers below it (LAYERS, lowest
          first: a layer is the first name after `restopo.`), and no other layer imports
          a PLUGINS layer: the backends are reached by name through restopo.registry.
          restopo/__init__.py is the package's facade: it may import anything, and
          anything may import it.
"""
from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "restopo"
LAYERS = ("grammars", "words", "worker", "io", "sizes", "codegen", "registry", "topology", "ir",
          "draw", "spec", "ops", "nn", "fx", "backends", "decode", "api", "train", "saved",
          "experiments", "cli", "commands", "__main__")
PLUGINS = ("backends",)


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file in the package folders pyproject.toml maps."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = {}
    for prefix, folder in config["package-dir"].items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = path
    return out


def import_graph(root: Path) -> nx.DiGraph:
    """Modules as nodes; an edge a -> b when a imports b, with the `where` of its first line."""
    files = module_files(root)
    g = nx.DiGraph()
    g.add_nodes_from(files)
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            for target in _targets(node, package, files):
                if target != name and not g.has_edge(name, target):
                    g.add_edge(name, target, where=f"{path.relative_to(root)}:{node.lineno}")
    return g


def _targets(node: ast.AST, package: str, known) -> list[str]:
    """The package's modules an import statement loads (the module itself, not its parents)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            anchor = ".".join(parts[:len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return []
    out = []
    for dotted in names:
        parts = dotted.split(".")
        found = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                      if ".".join(parts[:k]) in known), None)
        if found is not None:
            out.append(found)
    return out


def layer(module: str) -> str | None:
    """The layer a module belongs to; None for the facade (the package's __init__)."""
    return module.split(".")[1] if "." in module else None


def cycles(g: nx.DiGraph) -> list[str]:
    out = []
    for group in nx.strongly_connected_components(g):
        if len(group) < 2:
            continue
        loop = _shortest_cycle(g, group)
        path = " -> ".join(f"{a} ({g.edges[a, b]['where']})" for a, b in zip(loop, loop[1:]))
        out.append(f"import cycle among {', '.join(sorted(group))}: {path} -> {loop[0]}")
    return sorted(out)


def _shortest_cycle(g: nx.DiGraph, group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module (by name), both ends included."""
    sub = nx.DiGraph(sorted(g.subgraph(group).edges))  # sorted: the same cycle every run
    start = min(group)
    back = min((nx.shortest_path(sub, s, start) for s in sub.successors(start)), key=len)
    return [start, *back]


def layer_problems(g: nx.DiGraph, layers=LAYERS, plugins=PLUGINS) -> list[str]:
    out = []
    undeclared = sorted({layer(m) for m in g if layer(m) is not None} - set(layers))
    for name in undeclared:
        out.append(f"layer {name!r} ({PACKAGE}.{name}) is not in LAYERS: add it where it belongs")
    rank = {name: k for k, name in enumerate(layers)}
    for a, b, where in g.edges(data="where"):
        la, lb = layer(a), layer(b)
        if lb in plugins and la != lb and la is not None:
            out.append(f"{where}: {a} imports {b}; {lb} are reached through "
                       f"{PACKAGE}.registry, not imported")
        elif la in rank and lb in rank and rank[lb] > rank[la]:
            out.append(f"{where}: {a} imports {b}, but {la} sits below {lb} in the layers")
    return sorted(out)


def check(root: Path = ROOT, layers=LAYERS, plugins=PLUGINS) -> list[str]:
    """Every problem found, one line each; empty when the imports are in order."""
    g = import_graph(root)
    return cycles(g) + layer_problems(g, layers, plugins)


def main() -> int:
    problems = check()
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} import problem(s); layers, lowest first: {' < '.join(LAYERS)}")
        return 1
    print("imports ok: no cycles, no upward imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
