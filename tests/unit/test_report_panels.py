"""The run report's panels and header (sparserl/report/): the actor's, memory and KV-memory curves, shares on a fixed
[0, 1] axis, a 0/1 reward's band kept in [0, 1], reward and score drawn once when equal, the summary with "stopped at
step X of Y", and a header without the settings of groups that are off."""
import json

import pytest

from sparserl.report.curves import panels_present, reward_band, same_as
from sparserl.report.page import build_report, read_config, summary


def rows(steps=4, score_equal=True):
    out = []
    for s in range(1, steps + 1):
        m = 0.25 * s / steps
        out.append({"step": s, "reward/mean": m, "reward/std": (m * (1 - m)) ** 0.5, "score/mean": m if score_equal else m / 2,
                    "actor/loss": 0.1, "actor/pg_loss": 0.1, "actor/entropy": 1.5 - 0.1 * s, "actor/clip_frac": 0.01, "actor/grad_norm": 2.0,
                    "mem/peak_gb": 2.0, "mem/rss_gb": 1.5, "kv/peak_gb": 0.01, "mem/rollout_peak_gb": 1.9,
                    "mem/update_peak_gb": 2.0, "mem/peak_gb_max_rank": 2.1, "kv/retained_frac": 0.5, "perf/step_s": 30.0})
    out.insert(0, {"step": 0, "eval/env/avg@1": 0.6})
    out[-1]["eval/env/avg@1"] = 0.8
    return out


def test_new_panels_are_drawn_and_shares_have_a_fixed_axis():
    panels = {p.title: (p, keys) for p, keys in panels_present(rows())}
    assert panels["actor: entropy (nats per token)"][1] == ["actor/entropy"]
    assert panels["actor: clipped token shares"][1] == ["actor/clip_frac"] and panels["actor: clipped token shares"][0].share
    assert panels["actor: grad norm (before clipping)"][1] == ["actor/grad_norm"]
    panel, keys = panels["actor: loss"]
    assert keys == ["actor/loss"] and same_as(panel, keys, "actor/loss", rows()) == ["actor/pg_loss"]  # drawn once
    assert panels["memory per process (GB)"][1] == ["mem/peak_gb", "mem/rss_gb"]
    assert panels["KV cache: peak memory (GB)"][1] == ["kv/peak_gb"]
    assert panels["memory peak per phase (GB)"][1] == ["mem/rollout_peak_gb", "mem/update_peak_gb"]
    assert panels["evaluation (share correct)"][1] == ["eval/env/avg@1"] and panels["evaluation (share correct)"][0].share
    assert panels["KV cache kept (share of a dense cache)"][0].share


def test_reward_and_score_once_when_equal_and_the_band_of_a_0_1_reward_in_range():
    assert dict((p.title, k) for p, k in panels_present(rows()))["reward"] == ["reward/mean"]
    assert dict((p.title, k) for p, k in panels_present(rows(score_equal=False)))["reward"] == ["reward/mean", "score/mean"]
    steps, low, high = reward_band([{"step": 1, "reward/mean": 0.1, "reward/std": 0.3}, {"step": 2, "reward/mean": 0.9, "reward/std": 0.3}])
    assert steps == [1, 2] and low == [0.0, pytest.approx(0.6)] and high == [pytest.approx(0.4), 1.0]
    # Rewards in {-1, 1}: a std no reward in [0, 1] could have, so the band is not clipped.
    _, low, _ = reward_band([{"step": 1, "reward/mean": 0.2, "reward/std": 0.98}])
    assert low == [pytest.approx(-0.78)]


def test_summary_says_where_a_short_run_stopped():
    lines = dict(summary(rows(), {"trainer": {"total_steps": 30}}))
    assert lines["steps"] == "stopped at step 4 of 30"
    assert lines["reward (mean)"] == "0.062 (step 1) \u2192 0.250 (step 4)"
    assert lines["KV kept"] == "50.0% (step 1) \u2192 50.0% (step 4)"
    assert lines["eval/env/avg@1"] == "0.600 (step 0) \u2192 0.800 (step 4)"
    assert lines["peak memory"] == "2.00 GB per process, KV 0.010 GB" and lines["time"].startswith("2.0 min of steps")
    assert dict(summary(rows(), {"trainer": {"total_steps": 4}}))["steps"] == "4 of 4"


def write_run(folder, cfg):
    import yaml

    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return folder


def test_the_header_lists_only_settings_that_are_on(tmp_path):
    kv = {"algorithm": "none", "budget": 128, "divide_length": 16, "window": 8, "compress_prompt": False}
    dense = {"model": {"path": "m"}, "env": {"path": "envs/arithmetic.py"}, "data": {"train_path": ""},
             "rollout": {"n": 4, "kv": kv}, "algo": {"correction": {"enable": False, "veto": 1e-4}, "kl": {"coef": 0.0}},
             "trainer": {"total_steps": 30}}
    shown = read_config(write_run(tmp_path / "dense", dense))
    assert shown["rollout.kv.algorithm"] == "none" and shown["algo.correction.enable"] == "false"
    assert not {"rollout.kv.budget", "rollout.kv.compress_prompt", "algo.correction.veto", "algo.kl.coef"} & set(shown)
    sparse = {**dense, "rollout": {"n": 4, "kv": {**kv, "algorithm": "rkv", "compress_prompt": True}},
              "algo": {"correction": {"enable": True, "veto": 1e-4, "rescue": "none"}, "kl": {"coef": 0.01}}}
    shown = read_config(write_run(tmp_path / "sparse", sparse))
    assert shown["rollout.kv.budget"] == "128" and shown["rollout.kv.compress_prompt"] == "true"
    assert shown["algo.correction.veto"] == "0.0001" and shown["algo.kl.coef"] == "0.01" and "algo.correction.rescue" not in shown
    pytest.importorskip("matplotlib")
    page = build_report(tmp_path / "sparse").read_text()  # every panel above drawn (curves_svg)
    assert "stopped at step 4 of 30" in page and "data:image/svg+xml;base64," in page
