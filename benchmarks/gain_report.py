"""The dense-gain replication's statistics and summary (benchmarks/replicate_gain.py): held-out gains over the
warm-start from the per-run records, standard errors over seeds and over prompts, the share of dense's gain kept,
the tables and the seed-band plots."""
from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.common import print_table
from benchmarks.replicate_long import curves, mean_std, plot_bands
from benchmarks.replicate_sparse_rl import env_module, fmt

# the per-step metrics a run's record keeps (rescue/before_xi_p05: records made before sampler/xi_p05 replaced it)
KEPT = ("reward/mean", "kv/retained_frac", "kv/budget", "correction/rejected_seq_frac", "rescue/frac",
        "rescue/rejected_before_frac", "rescue/before_xi_p05", "sampler/xi_p05", "sampler/xi_p01",
        "sampler/rejected_seq_frac", "rescue/reward_mean", "mismatch/kl", "mismatch/xi_p05",
        "mismatch/xi_p01", "mismatch/low_xi_pos_adv_frac", "actor/entropy", "actor/grad_norm", "response/len_mean", "perf/step_s",
        "perf/rollout_s", "perf/update_s")
DIAGNOSTICS = ("kv/retained_frac", "kv/budget", "correction/rejected_seq_frac", "mismatch/xi_p05", "mismatch/kl",
               "actor/grad_norm", "response/len_mean", "perf/step_s")


def mean_se(values: list[float]) -> tuple[float, float | None] | None:
    """Mean and standard error of the mean (None for one value: no spread to estimate it from)."""
    ms = mean_std(values)
    n = len([v for v in values if v is not None and math.isfinite(v)])
    return None if ms is None else (ms[0], ms[1] / math.sqrt(n) if n > 1 else None)


def run_gain(rec: dict, base: list[float]) -> float:
    s = rec["eval"]["scores"]
    if len(s) != len(base):
        raise ValueError(f"{len(s)} held-out scores against the warm-start's {len(base)}")
    return sum(s) / len(s) - sum(base) / len(base)


def prompt_se(recs: list[dict], base: list[float]) -> float | None:
    """Standard error over prompts of each prompt's gain averaged over the seeds (a paired, per-prompt view)."""
    if not recs:
        return None
    per_prompt = [sum(r["eval"]["scores"][i] for r in recs) / len(recs) - b for i, b in enumerate(base)]
    ms = mean_std(per_prompt)
    return ms[1] / math.sqrt(len(per_prompt))


def share(gain: tuple[float, float] | None, dense: tuple[float, float] | None) -> str:
    """Share of dense's mean gain kept, with a first-order standard error (the two means independent)."""
    if gain is None or dense is None or dense[0] <= 0:
        return "-"
    q = gain[0] / dense[0]
    if gain[1] is None or dense[1] is None:
        return f"{q:.0%}"
    se = abs(q) * math.sqrt((gain[1] / gain[0]) ** 2 + (dense[1] / dense[0]) ** 2) if gain[0] else gain[1] / dense[0]
    return f"{q:.0%} ± {se:.0%}"


def run_mean(rec: dict, key: str) -> float | None:
    v = [m[key] for m in rec["metrics"] if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return sum(v) / len(v) if v else None


def final_batch_kv(rec: dict) -> float | None:
    """KV kept per trained sequence: `kv/retained_frac` is the compressed sampler's; the rescue replaces a share
    `rescue/frac` of the sequences by dense redraws (all of their KV) before the update."""
    kv, rescued = run_mean(rec, "kv/retained_frac"), run_mean(rec, "rescue/frac") or 0.0
    return None if kv is None else kv * (1.0 - rescued) + rescued


def xi_tail(rec: dict, q: str) -> float | None:
    """Mean over steps of the q-th percentile of xi (q = "p05" | "p01") over every sampled token before any filter
    (`sampler/xi_*`; records made before it existed carry the trained batch's `mismatch/xi_*`)."""
    v = run_mean(rec, f"sampler/xi_{q}")
    return run_mean(rec, f"mismatch/xi_{q}") if v is None else v


def time_ratio(group: list[dict], dense: list[dict], key: str) -> str:
    """Mean seconds per step (`perf/rollout_s` or `perf/step_s`) of a configuration's runs over dense's."""
    ours, base = mean_se([run_mean(r, key) for r in group]), mean_se([run_mean(r, key) for r in dense])
    return "-" if ours is None or base is None or base[0] <= 0 else f"{ours[0] / base[0]:.2f}"


def pm(stat, digits=3, sign=False) -> str:
    if stat is None:
        return "-"
    return fmt(stat[0], digits, sign) + ("" if stat[1] is None else f" ± {fmt(stat[1], digits)}")


def report(args, out: Path, records: Path, extra_configs: tuple[str, ...] = ()) -> str:
    """summary.md's text from the records (also printed), and the plots."""
    base_rec = records / "warm-start.json"
    if not base_rec.exists():
        return "no records yet"
    base = json.loads(base_rec.read_text())["eval"]["scores"]
    recs = {p.stem: json.loads(p.read_text()) for p in sorted(records.glob("*.json")) if "_seed" in p.stem}
    dense = [r for r in recs.values() if r["config"] == "dense"]
    dense_gain = mean_se([run_gain(r, base) for r in dense])
    text = [f"warm-start held-out score {sum(base) / len(base):.3f} ({len(base)} prompts x {args.eval_n}, dense, "
            f"temperature 1)" + "".join(
                f"; under {s} (budget {b}): {mean_of_scores(records / f'warm-start_{s}.json')}"
                for s, b in args.settings.items())]
    if args.eval_as_sampled:
        text.append("as sampled: each sparse run's policy is evaluated with its run's compression (rollout.kv.* of its "
                    "config.yaml), dense runs and the warm-start dense; its gain is over the dense warm-start")
    if dense_gain:
        text.append(f"dense held-out gain {dense_gain[0]:+.3f} ± {dense_gain[1]:.3f} (standard error over {len(dense)} "
                    f"seeds): {dense_gain[0] / dense_gain[1]:.1f} standard errors above zero" if dense_gain[1] is not None else
                    f"dense held-out gain {dense_gain[0]:+.3f} (one seed)")
    shown = [*args.configs, *(c for c in extra_configs if c not in args.configs and any(r["config"] == c for r in recs.values()))]
    for setting, budget in args.settings.items():
        rows, every, metrics, groups = [], [], {}, {}
        for c in shown:
            group = dense if c == "dense" else [r for r in recs.values() if r["setting"] == setting and r["config"] == c]
            groups[c] = group
            gains = [run_gain(r, base) for r in group]
            g = mean_se(gains)
            per = lambda key: mean_se([run_mean(r, key) for r in group])  # noqa: E731
            rows.append([c, len(group), pm(g, sign=True), fmt(prompt_se(group, base)),
                         share(g, dense_gain) if c != "dense" else "100%", pm(per("kv/retained_frac")),
                         pm(mean_se([final_batch_kv(r) for r in group])),
                         pm(per("correction/rejected_seq_frac")), pm(per("rescue/frac")),
                         pm(mean_se([xi_tail(r, "p05") for r in group]), 2), pm(mean_se([xi_tail(r, "p01") for r in group]), 2),
                         time_ratio(group, dense, "perf/rollout_s"), time_ratio(group, dense, "perf/step_s"),
                         pm(mean_se([r["wall_s"] / 60 for r in group]), 1)])
            for r, gain in zip(group, gains):
                metrics[(c, r["seed"])] = r["metrics"]
                every.append([c, r["seed"], fmt(gain, sign=True), fmt(run_mean(r, "reward/mean")),
                              fmt(run_mean(r, "kv/retained_frac")), fmt(run_mean(r, "kv/budget"), 0),
                              fmt(run_mean(r, "correction/rejected_seq_frac")), fmt(run_mean(r, "rescue/frac")),
                              fmt(xi_tail(r, "p05")), fmt(r["wall_s"] / 60, 1)])
        title = (f"{setting}: R-KV budget {budget}, divide_length {args.divide_length}, compress_prompt "
                 f"{'on' if args.compress_prompt else 'off'}")
        text.append(print_table(
            ["config", "seeds", "held-out gain ± SE (seeds)", "SE (prompts)", "share of dense gain",
             "KV kept per seq (sampler)", "KV of the trained seqs", "rejected seqs", "rescued seqs", "xi p05",
             "xi p01", "rollout s / dense", "step s / dense", "min per run"],
            rows, title=title))
        text.append(print_table(["config", "seed", "held-out gain", "train reward", "KV kept", "budget", "rejected",
                                 "rescued", "xi p05", "min"], every, title=f"{setting}: every run"))
        if metrics:
            curve = curves(metrics, [c for c in shown if any(k[0] == c for k in metrics)], DIAGNOSTICS)
            (out / f"{setting}_curves.json").write_text(json.dumps(curve, indent=1))
            plot_bands(curve, ["reward/mean"], out / f"{setting}_reward.png",
                       f"{Path(args.env).stem} ({args.links} links), {title}: training reward, mean ± std over seeds")
            plot_bands(curve, list(DIAGNOSTICS), out / f"{setting}_diagnostics.png",
                       f"{setting} (budget {budget}) diagnostics, mean ± std over seeds", cols=4)
        if args.task == "cycle_walk":
            text.append(first_mistakes(records, base, setting, groups, lap=args.links, steps=env_module(args).NUM_STEPS,
                                       as_sampled=args.eval_as_sampled))
    return "\n\n".join(text)


def walk_failures(scores: list[float], lap: int, steps: int) -> tuple[int, int, int, int]:
    """cycle_walk's held-out walks by where they first go wrong: (whole walks, first mistake in the first lap, in the
    second, later). A score is k / steps for the k steps followed; a lap is `lap` steps (one per link)."""
    k = [round(s * steps) for s in scores]
    return (sum(x >= steps for x in k), sum(x < lap for x in k), sum(lap <= x < 2 * lap for x in k),
            sum(2 * lap <= x < steps for x in k))


def first_mistakes(records: Path, base: list[float], setting: str, groups: dict[str, list[dict]], lap: int,
                   steps: int, as_sampled: bool = False) -> str:
    """Where each policy's held-out walks fail, mean over seeds (`groups`: configuration -> its records, as the
    setting's table has them; evaluated dense, or with the runs' compression when `as_sampled`): the second lap is
    where a compressed sampler has to read facts back from an evicted cache."""
    rows = [["warm-start", 1, *walk_failures(base, lap, steps)]]
    compressed = records / f"warm-start_{setting}.json"
    if compressed.exists():
        scores = json.loads(compressed.read_text())["eval"]["scores"]
        rows.append([f"warm-start_{setting} (compressed)", 1, *walk_failures(scores, lap, steps)])
    for c, group in groups.items():
        if group:
            counts = [walk_failures(r["eval"]["scores"], lap, steps) for r in group]
            rows.append([c, len(group), *(fmt(sum(col) / len(col), 1) for col in zip(*counts))])
    return print_table(["policy", "seeds", "whole walks", "first mistake in lap 1", "in lap 2", "later"], rows,
                       title=f"{setting}: where the held-out walks first go wrong (counts of prompts, mean over seeds; "
                             + ("the sparse runs' policies evaluated with their runs' compression)"
                                if as_sampled else "the trained policies evaluated dense)"))


def mean_of_scores(path: Path) -> str:
    if not path.exists():
        return "-"
    s = json.loads(path.read_text())["eval"]["scores"]
    return f"{sum(s) / len(s):.3f}"
