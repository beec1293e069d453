"""Assemble the report: one HTML file holding the curves (an SVG image), the logged samples (JSON) and the viewer
(`viewer.js`, `report.css`, inlined), so it opens from disk with no server and no network.

The header: a summary (how far the run got, "stopped at step X of Y" when short of `trainer.total_steps`; the
reward, the KV kept and the response length from the first steps to the last, averaged over 3 steps at each end;
each evaluation's first and last score; peak memory; time) and the run's settings, only those of groups that are
on (a dense run lists `rollout.kv.algorithm=none`, not a budget it never used).

Size: every logged step up to `max_steps`; past that, that many steps evenly spaced over the run (the first and the
last always in), and the page lists what it left out. With the default 4 records of <= ~0.3 MB per step and 40
steps, a page is at most ~50 MB and typically well under 1 MB.

Left out on purpose: a server or live reload (re-run the command), plotting libraries in the page (the curves are
drawn once, by matplotlib), and samples from runs without `trainer.log_samples` (the page says there are none).
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import yaml

from sparserl.report.curves import curves_svg, read_metrics
from sparserl.utils.errors import UserError
from sparserl.utils.runs import follow_latest

ASSETS = Path(__file__).parent
# The settings the header lists: (key, shown when). A group switched off (dense rollouts, no correction) lists its
# switch only, not the values that then mean nothing.
_KV_ON = lambda c: str(_get(c, "rollout.kv.algorithm")) not in ("none", "None")  # noqa: E731
_CORRECTION_ON = lambda c: bool(_get(c, "algo.correction.enable"))  # noqa: E731
CONFIG_KEYS = (
    ("model.path", None), ("env.path", lambda c: not _get(c, "data.train_path")), ("data.train_path", None),
    ("trainer.total_steps", None), ("trainer.prompts_per_step", None), ("rollout.n", None),
    ("rollout.max_new_tokens", None), ("rollout.temperature", None), ("actor.lr", None),
    ("rollout.kv.algorithm", None), ("rollout.kv.budget", _KV_ON), ("rollout.kv.divide_length", _KV_ON),
    ("rollout.kv.window", _KV_ON), ("rollout.kv.compress_prompt", _KV_ON),
    ("algo.correction.enable", None), ("algo.correction.mode", _CORRECTION_ON), ("algo.correction.veto", _CORRECTION_ON),
    ("algo.correction.token_low", _CORRECTION_ON), ("algo.correction.token_high", _CORRECTION_ON),
    ("algo.correction.is_cap", _CORRECTION_ON),
    ("algo.correction.rescue", lambda c: _CORRECTION_ON(c) and _get(c, "algo.correction.rescue") not in (None, "none")),
    ("algo.kl.coef", lambda c: bool(_get(c, "algo.kl.coef"))),
)
EDGE = 3  # steps averaged at each end of a curve in the summary (one step's 0/1 reward mean is noisy)


def _get(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def sample_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "samples"
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.glob("step_*.jsonl"):
        n = p.stem.removeprefix("step_")
        if n.isdigit():
            steps.append(int(n))
    return sorted(steps)


def spread(steps: list[int], limit: int) -> list[int]:
    """At most `limit` of `steps`, evenly spaced, first and last included."""
    if len(steps) <= limit:
        return steps
    if limit == 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (limit - 1))] for i in range(limit)})


def read_samples(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "samples" / f"step_{step}.jsonl"
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {n}: invalid JSON ({e.msg}); is the run still writing it?") from None
    return records


def load_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def read_config(run_dir: Path) -> dict[str, str]:
    """The header's settings (`CONFIG_KEYS`): each key's value where its condition holds."""
    cfg = load_config(run_dir)
    out = {}
    for key, shown in CONFIG_KEYS:
        value = _get(cfg, key)
        if value is not None and value != "" and (shown is None or shown(cfg)):
            out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _numbers(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows
            if r.get("step", 0) > 0 and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def _ends(points: list[tuple[int, float]], fmt: str = "{:.3f}") -> str:
    k = EDGE if len(points) >= 2 * EDGE else 1
    head, tail = points[:k], points[-k:]
    mean = lambda ps: sum(v for _, v in ps) / len(ps)  # noqa: E731
    span = lambda ps: f"step {ps[0][0]}" if len(ps) == 1 else f"steps {ps[0][0]}-{ps[-1][0]}"  # noqa: E731
    return f"{fmt.format(mean(head))} ({span(head)}) \u2192 {fmt.format(mean(tail))} ({span(tail)})"


def summary(rows: list[dict], cfg: dict) -> list[tuple[str, str]]:
    """(what, value) lines of the page's summary: how far the run got, reward and KV, evaluation, memory, time."""
    steps = [r["step"] for r in rows if r.get("step", 0) > 0]
    total = _get(cfg, "trainer.total_steps")
    out = []
    if steps:
        last = max(steps)
        if isinstance(total, int) and last < total:
            out.append(("steps", f"stopped at step {last} of {total}"))
        else:
            out.append(("steps", f"{last}" + (f" of {total}" if isinstance(total, int) else "")))
    for key, label, fmt in (("reward/mean", "reward (mean)", "{:.3f}"), ("kv/retained_frac", "KV kept", "{:.1%}"),
                            ("response/len_mean", "response length", "{:.1f}")):
        pts = _numbers(rows, key)
        if pts:
            out.append((label, _ends(pts, fmt)))
    evals = sorted({k for r in rows for k in r if k.startswith("eval/") and "@" in k and k.split("/")[-1].startswith("avg@")})
    for key in evals:
        pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            out.append((key, f"{pts[0][1]:.3f} (step {pts[0][0]}) \u2192 {pts[-1][1]:.3f} (step {pts[-1][0]})"))
    peak = _numbers(rows, "mem/peak_gb")
    if peak:
        out.append(("peak memory", f"{max(v for _, v in peak):.2f} GB per process" +
                    (f", KV {max(v for _, v in _numbers(rows, 'kv/peak_gb')):.3f} GB" if _numbers(rows, "kv/peak_gb") else "")))
    secs = _numbers(rows, "perf/step_s")
    if secs:
        total_s = sum(v for _, v in secs)
        out.append(("time", f"{total_s / 60:.1f} min of steps, {total_s / len(secs):.1f} s per step"))
    return out


def summary_html(items: list[tuple[str, str]]) -> str:
    if not items:
        return ""
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in items)
    return f'<table class="summary">{cells}</table>'


def _json_for_script(obj) -> str:
    # Inside <script>, "</script>" or "<!--" in a token's text would end the block: escape the characters instead.
    return json.dumps(obj, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def build_report(run_dir: str | Path, out: str | Path | None = None, max_steps: int = 40) -> Path:
    """Write the report of `run_dir` (default `run_dir/report.html`); returns its path."""
    run = follow_latest(run_dir)  # a folder of runs (outputs/grpo): its newest run
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run}: no metrics.jsonl; give the trainer.output_dir of a run")
    if max_steps < 1:
        raise UserError(f"--max-steps={max_steps}: must be >= 1")
    rows = read_metrics(metrics_path)
    if not rows:
        raise UserError(f"{metrics_path}: no step rows yet")
    try:
        svg = curves_svg(rows)
    except ValueError as e:
        raise UserError(f"{metrics_path}: {e}") from None
    logged = sample_steps(run)
    shown = spread(logged, max_steps)
    data = {
        "run": str(run.resolve().name),
        "config": read_config(run),
        "steps": [{"step": s, "records": read_samples(run, s)} for s in shown],
        "left_out": [s for s in logged if s not in set(shown)],
        "metric_steps": len(rows),
    }
    page = TEMPLATE.format(
        title=html.escape(f"sparserl report: {data['run']}"),
        summary=summary_html(summary(rows, load_config(run))),
        css=(ASSETS / "report.css").read_text(encoding="utf-8"),
        js=(ASSETS / "viewer.js").read_text(encoding="utf-8"),
        data=_json_for_script(data),
        svg=base64.b64encode(svg.encode("utf-8")).decode("ascii"),
    )
    target = Path(out) if out is not None else run / "report.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(target)
    return target


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<header><h1>{title}</h1><div id="run-summary">{summary}</div><div id="run-config"></div></header>
<section id="curves-section">
<h2>Curves <small>(metrics.jsonl)</small></h2>
<img id="curves" alt="training curves" src="data:image/svg+xml;base64,{svg}">
</section>
<section id="samples-section">
<h2>Samples <small>(samples/step_N.jsonl)</small></h2>
<div id="controls"></div>
<div id="legend"></div>
<div id="samples"></div>
</section>
<script id="report-data" type="application/json">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""
