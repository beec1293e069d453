"""The layout tells the architecture: which package may import which, and README's code map matches the tree.

Imports are read from the source (every `import` / `from ... import` statement, including those inside functions,
which is where lazy imports live; `if TYPE_CHECKING:` blocks are skipped since they never run), so a rule holds
for every code path, not only for what one test happens to import.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "sparserl"

# (importer prefix, forbidden prefixes): `sparserl.engines` matches the package and its submodules only.
RULES = [
    ("sparserl.engines", ("sparserl.actor", "sparserl.trainer", "sparserl.config", "sparserl.config_checks",
                          "sparserl.engine_options", "sparserl.rollout", "sparserl.eval")),
    ("sparserl.actor", ("sparserl.engines", "sparserl.rollout", "sparserl.trainer", "sparserl.engine_options")),
    ("sparserl.model", ("sparserl.actor", "sparserl.engines", "sparserl.rollout", "sparserl.trainer", "sparserl.config")),
    ("sparserl.kv", ("sparserl.actor", "sparserl.engines", "sparserl.rollout", "sparserl.trainer", "sparserl.config")),
    ("sparserl.algo", ("sparserl.actor", "sparserl.engines", "sparserl.rollout", "sparserl.trainer", "sparserl.config")),
    ("sparserl.eval", ("sparserl.trainer",)),
    ("sparserl.rollout", ("sparserl.actor", "sparserl.trainer", "sparserl.engines.native", "sparserl.engines.sglang")),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> set[str]:
    """Every sparserl module `path` imports at run time (a `from pkg import name` counts as pkg.name too, which
    covers importing a submodule by name)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
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
            visit(child)

    visit(tree)
    return {m for m in out if m == "sparserl" or m.startswith("sparserl.")}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        for importer, forbidden in RULES:
            if not _under(name, importer):
                continue
            for imported in sorted(imports_of(path)):
                if any(_under(imported, f) for f in forbidden):
                    found.append(f"{name} imports {imported}")
    return found


def test_package_boundaries():
    assert violations() == []


def test_the_walker_sees_lazy_imports_and_skips_type_checking(tmp_path):
    """The rule check would be worthless if it missed imports inside functions or counted TYPE_CHECKING ones."""
    fake = ROOT / "sparserl" / "engines" / "_layout_probe.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparserl.actor import actor\n"
                    "def f():\n    from sparserl.trainer import grpo\n    from . import protocol\n")
    try:
        got = imports_of(fake)
        assert "sparserl.trainer.grpo" in got and "sparserl.engines.protocol" in got
        assert not any(_under(m, "sparserl.actor") for m in got)
        assert "sparserl.engines._layout_probe imports sparserl.trainer" in violations()
    finally:
        fake.unlink()


def code_map() -> list[str]:
    """The paths in the first column of README.md's "Code map" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Code map", 1)[1].split("\n## ", 1)[0]
    paths = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            paths += re.findall(r"`([^`]+)`", first)
    return paths


def test_code_map_matches_the_tree():
    listed = code_map()
    assert listed, "README.md has no Code map table"
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in PKG.rglob("__init__.py") if p.parent != PKG}
    modules = {str(p.relative_to(ROOT)) for p in PKG.glob("*.py") if p.name != "__init__.py"}
    listed_packages = {p for p in listed if p.endswith("/")}
    listed_modules = {("sparserl/" + p if not p.startswith("sparserl/") else p) for p in listed if p.endswith(".py")}
    assert listed_packages == packages, (f"packages missing from the code map: {sorted(packages - listed_packages)}; "
                                         f"listed but not in the tree: {sorted(listed_packages - packages)}")
    assert listed_modules == modules, (f"top-level modules missing from the code map: {sorted(modules - listed_modules)}; "
                                       f"listed but not in the tree: {sorted(listed_modules - modules)}")


@pytest.mark.parametrize("path", ["sparserl/engines/", "sparserl/rollout/", "sparserl/model/", "sparserl/kv/"])
def test_code_map_names_the_core_packages(path):
    assert path in code_map()
