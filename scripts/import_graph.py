#!/usr/bin/env python3
"""Print the package dependency picture of carbonforge_runtime: which of its top-level packages
import which, with function-level imports included, and every import cycle among them.

    python scripts/import_graph.py              # package level (carbonforge_runtime.<package>)
    python scripts/import_graph.py --depth 3    # one level further down (carbonforge_runtime.a.b)
    python scripts/import_graph.py --modules    # cycles between modules, not packages

Exit status 1 when there is a cycle. Uses grimp, the graph library behind import-linter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "carbonforge_runtime"


def group(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def package_edges(graph: grimp.ImportGraph, depth: int) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        source = group(module, depth)
        edges.setdefault(source, set())
        for imported in graph.find_modules_directly_imported_by(module):
            target = group(imported, depth)
            if target != source and target.split(".")[0] == source.split(".")[0]:
                edges[source].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def module_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=2, help="name parts that make a package (default 2)")
    parser.add_argument("--modules", action="store_true", help="report cycles between modules")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    graph = grimp.build_graph(PACKAGE, include_external_packages=False, cache_dir=None)
    if args.modules:
        found = cycles(module_edges(graph))
    else:
        edges = package_edges(graph, args.depth)
        prefix = PACKAGE + "."
        for source in sorted(edges):
            targets = sorted(t.removeprefix(prefix) for t in edges[source])
            print(f"{source.removeprefix(prefix):28} -> {', '.join(targets) or '(nothing)'}")
        found = cycles(edges)
    for component in found:
        print("CYCLE: " + " <-> ".join(c.removeprefix(PACKAGE + ".") for c in component))
    if not found:
        print("no import cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
