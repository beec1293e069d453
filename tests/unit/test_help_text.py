"""No `opt()` help string and no docstring in sparserl/ quotes a benchmark figure.

A figure measured on one machine on one day ("~4x less update memory", "15-30 ms per decode step", "102 -> 87 s
per step") goes stale as soon as the code or the machine changes, and help text and docstrings are not re-measured.
They say what a setting or a function does and point to the benchmark or the docs page (docs/performance.md,
docs/results.md) where the current numbers live with their commands and machines.

The rule, read from the source with `ast` (module, class and function docstrings; the `help` and `choices_desc`
arguments of every `opt(...)` call, all string pieces of them joined): a number, or a range of numbers ("1.2-1.6",
"10 to 20"), directly followed by
- `x` with nothing after it but a non-word character ("4x", "1.2-1.6x"; not "0x9E37", not "64 x 49152", a shape),
- `%` ("23%"),
- `ms` as a word ("15 ms", "15-30 ms"),
- `s per` or `s/` as a unit of time per something ("87 s per step", "36 s/step").
A bound is not a measurement: a figure right after `<`, `>` (not an arrow `->`), `<=`, `>=`, "within", "fewer than", "more than",
"less than", "at least", "at most" or "up to" passes ("a token drawn at >= 10x the dense probability", "within 2x of
the need", "fewer than 5% of the tokens"), and so does a probability or confidence level ("98% probability").
Everything else passes too: defaults and thresholds ("0.2", "1e-4"), sizes ("64 MB", "8192 tokens"), counts, ratios
written as "a / b", and units of time alone ("30 s timeout").
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "sparserl"

_NUM = r"\d+(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.]){_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?(?:x(?!\w)|\s?%|\s?ms\b|\s?s (?:per)\b|\s?s/)")
BOUND = re.compile(r"(?:<|(?<!-)>|<=|>=|≤|≥|\bwithin|\bfewer than|\bmore than|\bless than|\bat least|\bat most|\bup to)\s*~?\s*$")
LEVEL = re.compile(r"\s*(?:probability|confidence)\b")
HELP_ARGS = ("help", "choices_desc")


def figures(text: str) -> list[str]:
    """The benchmark figures quoted in `text`."""
    return [m.group(0) for m in FIGURE.finditer(text)
            if not BOUND.search(text[:m.start()]) and not (m.group(0).endswith("%") and LEVEL.match(text, m.end()))]


def _strings(node: ast.AST) -> str:
    """Every string literal inside `node` (a literal, a concatenation, an f-string's text), joined."""
    return "".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _is_opt(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id == "opt") or (isinstance(f, ast.Attribute) and f.attr == "opt")


def texts(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, what, text) of every docstring and `opt()` help text of a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                line = node.body[0].lineno
                name = "module" if isinstance(node, ast.Module) else node.name
                out.append((line, f"docstring of {name}", doc))
        elif isinstance(node, ast.Call) and _is_opt(node):
            args = {"help": node.args[1]} if len(node.args) > 1 else {}
            args.update({k.arg: k.value for k in node.keywords if k.arg in HELP_ARGS})
            out += [(node.lineno, f"opt() {name}", _strings(value)) for name, value in args.items()]
    return out


def quoted_figures(path: Path) -> list[str]:
    """`file:line: what quotes '...'` for every figure in a module's docstrings and help texts."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for line, what, text in sorted(texts(ast.parse(path.read_text(encoding="utf-8")))):
        found += [f"{rel}:{line}: {what} quotes {fig!r}" for fig in figures(text)]
    return found


MODULES = sorted(PKG.rglob("*.py"))


def test_the_package_is_read():
    assert len(MODULES) > 50
    assert any(what.startswith("opt() help") for m in MODULES for _, what, _ in texts(ast.parse(m.read_text())))


@pytest.mark.parametrize("text, expected", [
    ("~4x less update memory", ["4x"]),
    ("1.2-1.6x faster decode GEMMs", ["1.2-1.6x"]),
    ("102 -> 87 s per step", ["87 s per"]),
    ("15-30 ms per decode step", ["15-30 ms"]),
    ("holds 23.1% of the dense KV", ["23.1%"]),
    ("a step took 36 s/step", ["36 s/"]),
    ("clip ratio (default 0.2), KL 1e-4, chunks of 64 MB", []),
    ("a (64 x 49152) buffer, key 0x9E3779B1, 8192 tokens, a 30 s timeout", []),
    ("the 5th percentile of xi, budget 128, up to 1.5x its value", []),
    ("drawn at >= 10x the dense probability, within 2x of the need, fewer than 5% of the tokens", []),
    ("enough with about 98% probability, and ~1.35x faster decode at batch 64", ["1.35x"]),
    ("version 2.13.0, sm_90, top-5", []),
])
def test_the_rule(text, expected):
    assert figures(text) == expected


def test_the_checker_reads_docstrings_and_help(tmp_path: Path):
    mod = tmp_path / "m.py"
    mod.write_text('"""Module: 2.5x faster."""\n'
                   "from x import opt\n"
                   "class C:\n"
                   '    """Fine: budget 128."""\n'
                   '    a: int = opt(1, "first " "takes ~15 ms")\n'
                   '    b: int = opt(2, help="fine, default 2", choices_desc="one of a, b (80% of runs)")\n'
                   "    def f(self):\n"
                   '        """Went from 102 to 87 s per step."""\n'
                   '        return "a literal that is not help: 9x"\n')
    assert quoted_figures(mod) == [f"{mod}:1: docstring of module quotes '2.5x'",
                                   f"{mod}:5: opt() help quotes '15 ms'",
                                   f"{mod}:6: opt() choices_desc quotes '80%'",
                                   f"{mod}:8: docstring of f quotes '102 to 87 s per'"]


def test_no_help_string_or_docstring_quotes_a_benchmark_figure():
    found = [f for m in MODULES for f in quoted_figures(m)]
    assert not found, ("help text and docstrings say what a setting does and point to the benchmark or "
                       "docs/performance.md for numbers:\n" + "\n".join(found))
