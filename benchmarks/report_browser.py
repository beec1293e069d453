"""Open a run's report (`python -m sparserl.report`) in headless Chromium: screenshot, console, what was drawn.

    python benchmarks/report_browser.py RUN_DIR --out docs/report_screenshot.png [--width 1400 --height 1800]

Builds RUN_DIR/report.html, loads it from disk in Chromium (`chromium` from Debian's packages, or $CHROMIUM) twice:
once with `--dump-dom` (the page after its script ran; the viewer writes what it drew into `body` data attributes:
`data-curves="loaded"`, `data-colouredTokens`, `data-cuts`) and once with `--screenshot`. Chromium's log
(`--enable-logging=stderr`) carries every console message of the page as a `CONSOLE` line; the page writes none
on its own, so any such line is an error. Prints the checks and exits 1 when one fails. tests/e2e/test_report.py
runs the same checks on a tiny run.

Left out on purpose: driving the page (clicks, the step selector) and pixel comparisons against a reference image;
a browser driver (Playwright, Selenium) would need a second browser download.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if shutil.which(explicit) or Path(explicit).is_file() else None
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageView:
    dom: str  # the document after the page's script ran
    console: list[str]  # the page's console messages (errors, warnings, logs, uncaught exceptions)
    screenshot: Path | None
    attrs: dict[str, str]  # data-* attributes of <body>


def _chromium(binary: str, args: list[str], page: Path, timeout: int) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="sparserl-chromium-") as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               "--disable-background-networking", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
               "--hide-scrollbars", "--virtual-time-budget=5000", *args, page.resolve().as_uri()]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def view(page: Path, screenshot: Path | None = None, width: int = 1400, height: int = 1800, timeout: int = 120,
         binary: str | None = None) -> PageView:
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    size = f"--window-size={width},{height}"
    res = _chromium(binary, ["--dump-dom", size], page, timeout)
    if res.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom failed ({res.returncode}): {res.stderr[-2000:]}")
    console = [line for line in res.stderr.splitlines() if ":CONSOLE" in line]
    body = re.search(r"<body([^>]*)>", res.stdout)
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(1))) if body else {}
    shot = None
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        res2 = _chromium(binary, [f"--screenshot={screenshot.resolve()}", size], page, timeout)
        if res2.returncode != 0 or not screenshot.is_file():
            raise RuntimeError(f"chromium --screenshot failed ({res2.returncode}): {res2.stderr[-2000:]}")
        console += [line for line in res2.stderr.splitlines() if ":CONSOLE" in line]
        shot = screenshot
    return PageView(res.stdout, console, shot, attrs)


def checks(v: PageView) -> list[tuple[str, bool]]:
    """(what, passed) for the things the report must show."""
    return [
        ("no console messages", not v.console),
        ("curves image loaded", v.attrs.get("curves") == "loaded"),
        ("at least one sample drawn", int(v.attrs.get("samples", "0")) > 0),
        ("at least one token coloured by log xi", int(v.attrs.get("coloured-tokens", "0")) > 0),
    ]


def main() -> None:
    from sparserl.report import build_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", default="docs/report_screenshot.png", help="screenshot PNG")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1800)
    args = ap.parse_args()
    page = build_report(args.run_dir)
    v = view(page, Path(args.out), args.width, args.height)
    print(f"report: {page} ({page.stat().st_size / 1024:.0f} KiB); screenshot: {v.screenshot}")
    print(f"drawn: step {v.attrs.get('step')}, {v.attrs.get('samples')} samples, {v.attrs.get('coloured-tokens')} coloured "
          f"tokens, {v.attrs.get('cuts')} compression marks")
    failed = False
    for what, ok in checks(v):
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        failed |= not ok
    for line in v.console:
        print(f"  console: {line}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
