"""Assemble the report: one HTML file holding the curves (an SVG image), the logged samples (JSON) and the viewer
(`viewer.js`, `report.css`, inlined), so it opens from disk with no server and no network.

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
CONFIG_KEYS = ("model.path", "rollout.n", "rollout.max_new_tokens", "rollout.kv.algorithm", "rollout.kv.budget",
               "rollout.kv.divide_length", "algo.correction.enable", "algo.correction.mode", "algo.correction.veto",
               "algo.correction.token_low", "algo.correction.token_high", "algo.correction.is_cap", "trainer.log_samples")


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


def read_config(run_dir: Path) -> dict[str, str]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    out = {}
    for key in CONFIG_KEYS:
        node = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[key] = str(node)
    return out


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
<header><h1>{title}</h1><div id="run-config"></div></header>
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
