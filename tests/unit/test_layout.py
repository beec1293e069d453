"""The layout tells the architecture: what each part of sparserl/ may import, docs/architecture.md's package table
against the real imports, and README's code map against the tree.

Imports are read from the source (tests/source_graph.py: every import statement, lazy ones inside functions
included, `if TYPE_CHECKING:` blocks skipped), so a rule holds for every code path, not only for what one test
happens to import. Each import is matched exactly: it lands in one module, and that module must be of the
importer's own part or allowed by name below.
"""
from __future__ import annotations

import re

import pytest

from tests.source_graph import PKG, ROOT, imports_of, modules, part, resolve, sparserl_graph

# What each part of sparserl/ (a top-level package or module) may import besides its own modules:
#   "x"             any module of part x;
#   "x.*"           the modules directly in package sparserl.x (not those of its subpackages);
#   "x.y.z"         exactly the module sparserl.x.y.z.
# Whatever is not listed is refused; utils (which imports nothing of sparserl but itself) is open to every part.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "sparserl": (),
    "utils": (),
    "model": ("kv.kv_dtype",),  # the pool's dtype accessor, read by the attention that writes the pool
    "kernels": ("engines.native.graph_step",),  # compile_check lists the static step's launches
    "rewards": (),
    "report": (),
    "parallel": (),
    "kv": ("config.fields",),
    "algo": ("config.fields",),
    "config": ("kv.policy", "algo.correction_config", "rollout.openreward.spec"),
    "cli": ("config",),
    "data": ("rewards",),
    "engines": ("model", "kv", "kernels"),
    "rollout": ("data", "engines.protocol", "engines.types"),
    "actor": ("model", "algo", "data", "parallel"),
    "engine_options": ("config", "engines", "kv", "actor.hf"),
    "eval": ("config", "cli", "parallel", "data", "kv", "rollout", "actor", "engines.*", "engine_options"),
    "trainer": ("config", "cli", "parallel", "data", "kv", "algo", "rollout", "actor", "engines.*", "engine_options",
                "eval"),
}
OPEN_TO_ALL = ("utils",)


def allowed(importer: str, imported: str) -> bool:
    """Whether module `importer` may import module `imported` under MAY_IMPORT."""
    mine = part(importer)
    if part(imported) in (mine, *OPEN_TO_ALL):
        return True
    for entry in MAY_IMPORT[mine]:
        name = "sparserl." + entry.removesuffix(".*")
        if entry.endswith(".*"):
            if imported.rpartition(".")[0] == name:
                return True
        elif "." not in entry:
            if part(imported) == entry:
                return True
        elif imported == name:
            return True
    return False


def violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} imports {t}" for m in sorted(graph) for t in sorted(graph[m]) if not allowed(m, t)]


def test_every_part_has_a_rule():
    parts = {part(m) for m in modules()}
    assert parts == set(MAY_IMPORT), (f"parts without a rule: {sorted(parts - set(MAY_IMPORT))}; "
                                      f"rules for parts that are gone: {sorted(set(MAY_IMPORT) - parts)}")


def test_package_boundaries():
    assert violations(sparserl_graph()) == []


def test_the_rules_match_exactly():
    """A module name that merely starts like an allowed one is not allowed (`config_checks` is not `config`), and a
    whole part, a package's direct modules and one module each allow just what they say."""
    assert allowed("sparserl.kv.policy", "sparserl.config.fields")
    assert not allowed("sparserl.kv.policy", "sparserl.config.schema")
    assert not allowed("sparserl.kv.policy", "sparserl.config")
    assert not allowed("sparserl.kv.policy", "sparserl.config_fields")
    assert allowed("sparserl.trainer.grpo", "sparserl.engines.protocol")
    assert not allowed("sparserl.trainer.grpo", "sparserl.engines.native.engine")
    assert allowed("sparserl.engine_options.build", "sparserl.engines.native.options")
    assert not allowed("sparserl.rollout.worker", "sparserl.engines.weight_sync")
    assert not allowed("sparserl.utils.logging", "sparserl.config.fields")


def test_the_reader_sees_lazy_imports_and_skips_type_checking():
    """The rule check would be worthless if it missed imports inside functions or counted TYPE_CHECKING ones."""
    fake = PKG / "engines" / "_layout_probe.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparserl.actor import actor\n"
                    "def f():\n    from sparserl.trainer import grpo\n    from . import protocol\n"
                    "    import importlib\n    importlib.import_module('sparserl.rollout.worker')\n")
    try:
        got = imports_of(fake)
        assert "sparserl.trainer.grpo" in got and "sparserl.engines.protocol" in got
        assert "sparserl.rollout.worker" in got
        assert not any(m == "sparserl.actor" or m.startswith("sparserl.actor.") for m in got)
        known = modules()
        targets = {resolve(m, known) for m in got}
        graph = {"sparserl.engines._layout_probe": {t for t in targets if t}}
        assert "sparserl.engines._layout_probe imports sparserl.trainer.grpo" in violations(graph)
        assert "sparserl.engines._layout_probe imports sparserl.rollout.worker" in violations(graph)
    finally:
        fake.unlink()


# --- docs/architecture.md's package table -------------------------------------------------------------------------
def architecture_table() -> dict[str, set[str]]:
    """part -> the parts its row of docs/architecture.md's table says import it (after `<-`; "(imported by
    nothing)" is the empty set)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Packages and who may import whom", 1)[1].split("```", 2)[1]
    rows = {}
    for line in block.splitlines():
        m = re.match(r"\s+([a-z_]+)(?:/|\.py)\s", line)
        if not m:
            continue
        importers = line.split("<-", 1)[1] if "<-" in line else ""
        rows[m.group(1)] = {w.strip() for w in importers.split(",") if w.strip()}
    return rows


def real_importers() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {part(m): set() for m in modules()}
    for importer, targets in sparserl_graph().items():
        for t in targets:
            if part(t) != part(importer):
                out[part(t)].add(part(importer))
    return out


def test_the_architecture_table_names_the_real_importers():
    table, real = architecture_table(), real_importers()
    real.pop("sparserl", None)
    assert set(table) == set(real), (f"parts missing from the table: {sorted(set(real) - set(table))}; "
                                     f"rows for parts that are gone: {sorted(set(table) - set(real))}")
    wrong = {p: f"the table says <- {sorted(table[p])}, the code: {sorted(real[p])}" for p in real if table[p] != real[p]}
    assert not wrong, wrong


# --- README's code map --------------------------------------------------------------------------------------------
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
    top_modules = {str(p.relative_to(ROOT)) for p in PKG.glob("*.py") if p.name != "__init__.py"}
    listed_packages = {p for p in listed if p.endswith("/")}
    listed_modules = {("sparserl/" + p if not p.startswith("sparserl/") else p) for p in listed if p.endswith(".py")}
    assert listed_packages == packages, (f"packages missing from the code map: {sorted(packages - listed_packages)}; "
                                         f"listed but not in the tree: {sorted(listed_packages - packages)}")
    assert listed_modules == top_modules, (f"top-level modules missing from the code map: "
                                           f"{sorted(top_modules - listed_modules)}; "
                                           f"listed but not in the tree: {sorted(listed_modules - top_modules)}")


@pytest.mark.parametrize("path", ["sparserl/engines/", "sparserl/rollout/", "sparserl/model/", "sparserl/kv/",
                                  "sparserl/config/"])
def test_code_map_names_the_core_packages(path):
    assert path in code_map()
