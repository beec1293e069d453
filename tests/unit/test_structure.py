"""The structure rules of sparserl/ that hold for every module: no import cycles, no function longer than 80
lines, and the trainer's step as one short method.

The import graph is read from the source (tests/source_graph.py: imports inside functions included, `if
TYPE_CHECKING:` ones not), so a cycle closed through a lazy import fails here too; a failure names each cycle,
module by module. Function lengths run from the `def` line to the last line of the body (decorators not counted).
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.source_graph import PKG, ROOT, graph, sparserl_graph

MAX_FUNCTION_LINES = 80


def _components(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `g` with more than one module (Tarjan's, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _shortest_cycle(g: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One shortest cycle through the first module of `comp`, inside `comp`: [a, b, ..., a]."""
    members, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(g[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{comp} is no cycle")


def cycles(g: dict[str, set[str]]) -> list[str]:
    """Every import cycle of `g` as "a -> b -> ... -> a" (one per group of modules that import each other; the
    group's other modules follow in brackets when the cycle shown does not pass through all of them)."""
    out = []
    for comp in _components(g):
        path = _shortest_cycle(g, comp)
        rest = sorted(set(comp) - set(path))
        out.append(" -> ".join(path) + (f" (and, in the same cycle group: {', '.join(rest)})" if rest else ""))
    return out


def test_no_import_cycles():
    found = cycles(sparserl_graph())
    assert not found, "import cycles in sparserl/:\n  " + "\n  ".join(found)


def test_a_cycle_is_found_and_named(tmp_path):
    """Three modules of a throwaway package: a imports b at the top, b imports a inside a function (a lazy import
    closes the cycle), c imports a only under TYPE_CHECKING (no cycle through c)."""
    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkgx import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkgx.a import thing\n    return thing\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkgx import a\n"
                              "from pkgx import b\n")
    g = graph(pkg, tmp_path)
    # `from pkgx import b` runs pkgx/__init__.py too, so it is an edge to the package as well
    assert g["pkgx.a"] == {"pkgx", "pkgx.b"} and g["pkgx.b"] == {"pkgx.a"} and g["pkgx.c"] == {"pkgx", "pkgx.b"}
    assert cycles(g) == ["pkgx.a -> pkgx.b -> pkgx.a"]
    (pkg / "c.py").write_text("import pkgx.a\n")
    (pkg / "a.py").write_text("from pkgx import c\n")
    assert cycles(graph(pkg, tmp_path)) == ["pkgx.a -> pkgx.c -> pkgx.a"]


def test_a_longer_cycle_is_named_in_order():
    g = {"m.a": {"m.b"}, "m.b": {"m.c"}, "m.c": {"m.a", "m.d"}, "m.d": set(), "m.e": {"m.a"}}
    assert cycles(g) == ["m.a -> m.b -> m.c -> m.a"]
    g["m.d"] = {"m.b"}
    assert cycles(g) == ["m.a -> m.b -> m.c -> m.a (and, in the same cycle group: m.d)"]


def functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, number of lines) of every function and method in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_no_function_is_longer_than_80_lines():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in sorted(PKG.rglob("*.py"))
            for name, line, n in functions(p) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(long)


def test_function_lengths_are_measured_from_def_to_the_end(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class K:\n    @staticmethod\n    def long():\n" + "\n".join(f"        x{i} = {i}" for i in range(80))
                   + "\n\n\ndef short():\n    return 1\n")
    assert functions(src) == [("K.long", 3, 81), ("short", 86, 2)]


def test_the_training_step_is_one_short_method():
    """The trainer's step reads as one method, `train_step`, of at most 80 lines."""
    found = [(p.relative_to(ROOT), name, n) for p in sorted((PKG / "trainer").glob("*.py"))
             for name, _, n in functions(p) if "." in name and name.rsplit(".", 1)[1] == "train_step"]
    assert found, "no train_step method in sparserl/trainer/"
    assert all(n <= MAX_FUNCTION_LINES for _, _, n in found), found
