"""The metric registry (sparserl/trainer/metric_names.py, rendered as docs/metrics.md) against the source.

Every metric-shaped string in sparserl/ (a literal such as "kv/peak_gb", or an f-string such as
f"eval/{name}/{k}") must be a registered metric or family, or listed as not logged; every exact registered name
must still be built somewhere (as a literal, or by an f-string from a name the source spells out); the timer
phases of the trainer and the tool counters of the OpenReward driver must be the registry's. A real run's keys
are checked by tests/e2e/test_metric_names.py.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from sparserl.trainer import metric_names as M

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sparserl"
REGISTRY = PACKAGE / "trainer" / "metric_names.py"
_PART = r"[\w@.{}]+"
SHAPED = re.compile(rf"(?:{'|'.join(g for g in M.GROUPS if g != 'step')})/{_PART}(?:/{_PART})*")


def source_strings() -> tuple[dict[str, set[str]], set[str]]:
    """({metric-shaped string: files}, every string literal) of sparserl/, the registry left out. An f-string's
    replacement fields read as `{}`."""
    shaped: dict[str, set[str]] = {}
    literals: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                literals.add(text)
            else:
                continue
            if SHAPED.fullmatch(text):
                shaped.setdefault(text, set()).add(str(path.relative_to(ROOT)))
    return shaped, literals


SHAPED_NAMES, LITERALS = source_strings()
INTERNAL = [(name, M.pattern(name)) for name in M.INTERNAL]


def wildcard(text: str) -> re.Pattern:
    """An f-string's text as a pattern: `{}` is any non-empty part."""
    return re.compile("(.+)".join(re.escape(p) for p in text.split("{}")))


def test_the_scan_sees_the_metrics():
    assert {"reward/mean", "mismatch/kl", "kv/peak_gb", "eval/{}/{}", "perf/{}_s"} <= set(SHAPED_NAMES)


def test_every_metric_name_in_the_source_is_registered():
    missing = []
    for text, files in sorted(SHAPED_NAMES.items()):
        if "{}" in text:  # an f-string: some registry name must be of its shape
            rx = wildcard(text)
            ok = any(rx.fullmatch(name) for name in [m.name for m in M.METRICS] + list(M.INTERNAL))
        else:
            ok = M.find(text) is not None or any(rx.fullmatch(text) for _, rx in INTERNAL)
        if not ok:
            missing.append(f"{text} ({', '.join(sorted(files))})")
    assert not missing, ("metric names in the source that sparserl/trainer/metric_names.py does not list (add them "
                         "to METRICS, or to INTERNAL if they are never logged, then run python scripts/gen_reference.py):\n"
                         + "\n".join(missing))


def test_every_registered_name_is_built_by_the_source():
    templates = [wildcard(t) for t in SHAPED_NAMES if "{}" in t]
    stale = []
    for name in [m.name for m in M.METRICS] + list(M.INTERNAL):
        if "<" in name or name in LITERALS:
            continue  # families are checked by the run, the phases and the counters
        # Built by an f-string whose variable parts the source spells out (f"actor/{k}" with "clip_frac").
        if not any((hit := rx.fullmatch(name)) and all(part in LITERALS for part in hit.groups()) for rx in templates):
            stale.append(name)
    assert not stale, f"registered metrics that no code builds any more: {stale}"


def test_timer_phases_are_the_registry_phases():
    tree = ast.parse((PACKAGE / "trainer" / "trainer.py").read_text(encoding="utf-8"))

    def is_timers(f):  # `timers(NAME)` in train_step, `self.timers(NAME)` in the methods it calls
        return (isinstance(f, ast.Name) and f.id == "timers") or (isinstance(f, ast.Attribute) and f.attr == "timers")
    phases = {node.args[0].value for node in ast.walk(tree)
              if isinstance(node, ast.Call) and is_timers(node.func) and node.args and isinstance(node.args[0], ast.Constant)}
    assert phases == set(M.PHASES)


def test_tool_counters_are_the_driver_counters():
    tree = ast.parse((PACKAGE / "rollout" / "openreward" / "driver.py").read_text(encoding="utf-8"))
    (stats,) = [ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "TOOL_STATS" for t in node.targets)]
    assert tuple(stats) == tuple(M.TOOL_COUNTERS)


def test_find_matches_families_and_nothing_else():
    assert M.find("reward/mean").name == "reward/mean"
    assert M.find("perf/rollout_s").name == "perf/<phase>_s"
    assert M.find("perf/rollout_tok_s").name == "perf/rollout_tok_s"
    assert M.find("mem/update_peak_gb").name == "mem/<phase>_peak_gb"
    assert M.find("eval/gsm8k/pass@4").name == "eval/<set>/pass@<k>"
    assert M.find("eval/gsm8k/maj@8").name == "eval/<set>/maj@<n>"
    assert M.find("openreward/local_GuessNumber/samples").name == "openreward/<env>/samples"
    for key in ("perf/bogus_s", "eval/gsm8k/pass@k", "eval/a/b/prompts", "reward/mean2", "kv/nope"):
        assert M.find(key) is None, key
