"""The import graph of sparserl/, read from the source (tests/unit/test_layout.py and test_structure.py use it).

Every `import` / `from ... import` statement counts, including those inside functions, which is where lazy imports
live, and `importlib.import_module("sparserl....")` with a literal name; `if TYPE_CHECKING:` blocks are skipped
since they never run. So a rule holds for every code path, not only for what one test happens to import. An
import of `a.b.c` is an edge to the module `a.b.c` (a `from pkg import name` names the module `pkg.name` where that
is a module, else `pkg`).
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sparserl"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_module_literal(node: ast.Call) -> str | None:
    f = node.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (isinstance(f, ast.Name) and f.id == "import_module")
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(path: Path, root: Path = ROOT, top: str = "sparserl") -> set[str]:
    """Every `top` name `path` imports at run time (a `from pkg import name` counts as pkg.name too, which covers
    importing a submodule by name)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)
            elif isinstance(child, ast.Call) and (name := _import_module_literal(child)):
                out.add(name)
            visit(child)

    visit(tree)
    return {m for m in out if m == top or m.startswith(top + ".")}


def modules(pkg: Path = PKG, root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package at `pkg`, by dotted name."""
    return {module_name(p, root): p for p in sorted(pkg.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported name lands in: the name itself, or the nearest enclosing module (`pkg.Config` ->
    `pkg`); None when nothing of it is a module of the tree."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def graph(pkg: Path = PKG, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (itself excluded)."""
    known = modules(pkg, root)
    top = module_name(pkg / "__init__.py", root)
    out = {}
    for name, path in known.items():
        targets = {resolve(i, known) for i in imports_of(path, root, top)}
        out[name] = {t for t in targets if t is not None and t != name}
    return out


@cache
def sparserl_graph() -> dict[str, set[str]]:
    return graph()


def part(module: str) -> str:
    """The part of sparserl/ a module belongs to: its top-level package or module (`sparserl.kv.policy` -> `kv`,
    `sparserl.cli` -> `cli`); `sparserl` itself for the package's own __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]
