"""docs/config.md and docs/metrics.md are generated from the code (scripts/gen_reference.py): regenerated here in
memory, each must equal the committed page, so a config key, default, description or metric that changes without
its page fails CI."""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = load_generator()


@pytest.mark.parametrize("page", sorted(GEN.PAGES))
def test_committed_page_equals_the_generated_one(page):
    want = GEN.PAGES[page]()
    path = ROOT / page
    assert path.is_file(), f"{page} is missing: run python scripts/gen_reference.py"
    have = path.read_text(encoding="utf-8")
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), page, "generated"))[:40])
    assert have == want, f"{page} is stale: run python scripts/gen_reference.py\n{diff}"


def test_config_page_lists_every_key_with_the_default_a_run_gets():
    from sparserl.cli import sections
    from sparserl.config.load import load_config

    text = (ROOT / GEN.CONFIG_PAGE).read_text(encoding="utf-8")
    for section in sections(load_config([])):
        for key in section.keys:
            assert f"| `{key.key}` |" in text, key.key
    # the schema's default, which is what a run gets (configs/grpo.yaml sets no value)
    assert "| `actor.lr` | `float` | `5e-06` | AdamW learning rate after warmup [>= 0] |" in text
    assert "| `rollout.kv.budget` | `int \\| str` | `512` |" in text
    assert "| key | grpo | eval | gpu |" in text  # the other base configs, by what they change


def test_metrics_page_lists_every_registered_metric():
    from sparserl.trainer.metric_names import INTERNAL, METRICS, PHASES

    text = (ROOT / GEN.METRICS_PAGE).read_text(encoding="utf-8")
    for name in [m.name for m in METRICS] + list(INTERNAL) + [f"`{p}`" for p in PHASES]:
        assert name in text, name


def test_check_mode_names_a_stale_page(tmp_path, monkeypatch):
    for page in GEN.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(GEN.PAGES[page]())
    assert GEN.stale_pages(tmp_path) == []
    (tmp_path / GEN.METRICS_PAGE).write_text("# Metrics\n")
    assert GEN.stale_pages(tmp_path) == [GEN.METRICS_PAGE]
