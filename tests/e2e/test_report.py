"""`python -m sparserl.report` on a tiny sparse_rl run: a self-contained page with every logged step, opened in
headless Chromium (skipped where none is installed) with no console message, the curves loaded and tokens coloured."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.report_browser import checks, find_chromium, view
from sparserl.report.page import spread
from tests.e2e.test_trainer import ROOT, read_metrics, tiny_args, trainer, write_data
from tests.launch import command

SPARSE = {"+preset": "sparse_rl", "rollout.kv.budget": 16, "rollout.kv.window": 4, "rollout.kv.divide_length": 8,
          "rollout.kv.kernel": 3, "rollout.kv.compress_prompt": "true", "rollout.max_new_tokens": 16,
          "trainer.log_samples": 3, "trainer.export_hf": "false"}


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]]
    data = write_data(tmp / "train.jsonl", rows)
    out = tmp / "run"
    res = trainer(tiny_args(tiny_checkpoint, data, ROOT / "envs" / "arithmetic.py", out, steps=3, **SPARSE))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def report(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(1, "-m", "sparserl.report", run_dir, *args), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def embedded(page: str) -> dict:
    block = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    return json.loads(block)


def test_page_holds_every_step_and_nothing_remote(run):
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["perf/log_samples_s"] > 0 for m in metrics)
    res = report(run)
    assert res.returncode == 0, res.stderr
    page_path = Path(res.stdout.strip())
    assert page_path == run / "report.html"
    page = page_path.read_text()
    data = embedded(page)
    assert [s["step"] for s in data["steps"]] == [1, 2, 3] and data["left_out"] == []
    for s in data["steps"]:
        on_disk = [json.loads(x) for x in (run / "samples" / f"step_{s['step']}.jsonl").read_text().splitlines()]
        assert s["records"] == on_disk and len(on_disk) == 3
    assert any(r["compressed_at"] for s in data["steps"] for r in s["records"])
    assert data["config"]["rollout.kv.algorithm"] == "rkv" and data["config"]["rollout.kv.compress_prompt"] == "true"
    assert "stopped at step" not in page and "<th>steps</th><td>3 of 3</td>" in page  # the summary in the header
    # Self-contained: the curves are a data: image, scripts and styles are inline, nothing is fetched.
    assert re.search(r'<img id="curves"[^>]*src="data:image/svg\+xml;base64,', page)
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:|//)', page) and "@import" not in page and "url(http" not in page


def test_max_steps_and_errors(run, tmp_path):
    res = report(run, "--out", str(tmp_path / "r.html"), "--max-steps", "2")
    assert res.returncode == 0, res.stderr
    data = embedded((tmp_path / "r.html").read_text())
    assert [s["step"] for s in data["steps"]] == [1, 3] and data["left_out"] == [2]
    assert spread(list(range(1, 101)), 5) == [1, 26, 51, 75, 100]
    missing = report(tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "metrics.jsonl" in missing.stderr


def test_report_renders_in_headless_chromium(run, tmp_path):
    if find_chromium() is None:
        pytest.skip("Chromium is not installed (apt-get install chromium); the report's browser check needs it")
    res = report(run)
    assert res.returncode == 0, res.stderr
    shot = tmp_path / "report.png"
    v = view(run / "report.html", shot, width=1200, height=1400)
    assert all(ok for _, ok in checks(v)), (checks(v), v.console)
    assert v.attrs["step"] == "3" and int(v.attrs["cuts"]) > 0  # the last step is shown, compression points marked
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1400)
    # The page is not blank: the curves' line colours and the token backgrounds put many distinct colours on it.
    assert len(img.getcolors(maxcolors=1 << 20)) > 100
