"""What an entry point's process sets up, each checked in a fresh Python: `run_main` turns a user error into one line
and exit code 2, and `tune_malloc` / `reuse_heap` tune glibc's allocator (sparserl/utils/errors.py,
sparserl/utils/memory.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_run_main_user_error_is_one_line_exit_2():
    proc = _run_python(
        "from sparserl.utils.errors import UserError, run_main\n"
        "def main():\n    raise UserError('data.prompt_key: column \"q\" missing in\\ntrain.jsonl')\n"
        "run_main(main)\n")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ['error: data.prompt_key: column "q" missing in train.jsonl']
    assert proc.stdout == ""


def test_run_main_missing_file_and_bugs():
    missing = _run_python("from sparserl.utils.errors import run_main\n"
                          "run_main(lambda: open('/nonexistent/x.jsonl'))\n")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1
    assert missing.stderr.startswith("error: ") and "/nonexistent/x.jsonl" in missing.stderr
    bug = _run_python("from sparserl.utils.errors import run_main\n"
                      "def main():\n    raise KeyError('bug')\nrun_main(main)\n")
    assert bug.returncode == 1 and "Traceback" in bug.stderr
    ok = _run_python("from sparserl.utils.errors import run_main\nrun_main(lambda: print('done'))\n")
    assert ok.returncode == 0 and ok.stdout == "done\n"


def _run_tuned(script: str):
    """`script` in a fresh Python whose glibc the entry points' way would tune (no override in the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "SPARSERL_MALLOC_TUNE")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def test_tune_malloc_returns_large_frees_to_the_os(tmp_path):
    """With the fixed mmap threshold, freed 8 MB tensors do not stay resident after a larger one was freed first.
    (Without it, glibc's dynamic threshold moves such sizes onto the heap, where small live tensors pin them: this
    pattern left 24-512 MB resident in runs on this project's CI box, depending on the heap's state.)"""

    script = (
        "import torch\n"
        "from sparserl.utils.memory import rss_bytes, tune_malloc\n"
        "assert tune_malloc()\n"
        "x = torch.ones(16 << 20, dtype=torch.uint8); del x\n"  # would raise glibc's threshold past 16 MB untuned
        "keep = []\n"
        "base = rss_bytes()\n"
        "for i in range(64):\n"
        "    a = torch.ones(8 << 20, dtype=torch.uint8); b = torch.ones(64, dtype=torch.uint8); keep.append(b); del a\n"
        "print((rss_bytes() - base) / 2**20)\n"
    )
    res = _run_tuned(script)
    grown_mb = float(res.stdout.strip().splitlines()[-1])
    assert grown_mb < 4, grown_mb  # each 8 MB block unmapped when freed


def test_tune_malloc_gives_tensors_huge_pages_after_the_entry_points_imports():
    """The entry points import torch, transformers and the trainer before `run_main` calls `tune_malloc`; torch still
    takes the huge-page setting from there: the mappings of tensors of 2 MB or more are then madvised for huge pages
    (`hg` in their /proc/self/smaps VmFlags), smaller ones are not, and `SPARSERL_MALLOC_TUNE=0` leaves torch's
    allocator as it was."""
    from sparserl.utils.memory import _huge_pages_offered

    if not _huge_pages_offered():
        pytest.skip("the kernel offers no transparent huge pages")
    script = (
        "import sparserl.trainer.grpo, sparserl.trainer.sft, sparserl.eval.__main__\n"
        "import torch\n"
        "from sparserl.utils.memory import tune_malloc\n"
        "print(tune_malloc())\n"
        "def huge(t):\n"
        "    ptr, flags, inside = t.data_ptr(), None, False\n"
        "    for line in open('/proc/self/smaps'):\n"
        "        head = line.split()[0]\n"
        "        if '-' in head and not head.endswith(':'):\n"
        "            lo, hi = (int(x, 16) for x in head.split('-'))\n"
        "            inside = lo <= ptr < hi\n"
        "        elif inside and head == 'VmFlags:':\n"
        "            return 'hg' in line.split()[1:]\n"
        "    return False\n"
        "big = [torch.ones(3 << 20, dtype=torch.uint8) for _ in range(4)]\n"
        "small = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(4)]\n"
        "print(sum(map(huge, big)), sum(map(huge, small)))\n"
    )
    base = {k: v for k, v in os.environ.items()
            if k not in ("MALLOC_MMAP_THRESHOLD_", "SPARSERL_MALLOC_TUNE", "THP_MEM_ALLOC_ENABLE")}
    out = {}
    for tune in ("1", "0"):
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env={**base, "SPARSERL_MALLOC_TUNE": tune})
        assert res.returncode == 0, res.stderr[-2000:]
        out[tune] = res.stdout.split()[-3:]
    assert out == {"1": ["True", "4", "0"], "0": ["False", "0", "0"]}, out


def test_reuse_heap_keeps_large_tensors_on_the_heap_inside_and_unmaps_them_after():
    """Inside `reuse_heap` an 8 MB tensor comes from glibc's heap (where freed blocks are kept for the next ones);
    outside, before and after, each is its own mapping, and freed blocks go back to the OS (the threshold is back
    at 1 MiB)."""
    script = (
        "import torch\n"
        "from sparserl.utils.memory import reuse_heap, rss_bytes, tune_malloc\n"
        "assert tune_malloc()\n"
        "def in_heap(ptr):\n"
        "    for line in open('/proc/self/maps'):\n"
        "        if line.rstrip().endswith('[heap]'):\n"
        "            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "            if lo <= ptr < hi:\n"
        "                return True\n"
        "    return False\n"
        "def make():\n"
        "    return torch.ones(8 << 20, dtype=torch.uint8)\n"
        "a = make(); before = in_heap(a.data_ptr()); del a\n"
        "with reuse_heap():\n"
        "    a = make(); inside = in_heap(a.data_ptr()); del a\n"
        "a = make(); after = in_heap(a.data_ptr()); del a\n"
        "keep = []\n"
        "base = rss_bytes()\n"
        "for i in range(64):\n"
        "    a = make(); b = torch.ones(64, dtype=torch.uint8); keep.append(b); del a\n"
        "print(before, inside, after, (rss_bytes() - base) / 2**20)\n"
    )
    res = _run_tuned(script)
    before, inside, after, grown_mb = res.stdout.split()[-4:]
    assert (before, inside, after) == ("False", "True", "False"), res.stdout
    assert float(grown_mb) < 4, grown_mb  # each 8 MB block unmapped when freed
    # Untuned (SPARSERL_MALLOC_TUNE=0) glibc is left as it is: reuse_heap changes nothing.
    res = subprocess.run([sys.executable, "-c", "import sparserl.utils.memory as m\nprint(m.tune_malloc())\n"
                          "with m.reuse_heap(): pass\nprint(m._tuned)"], capture_output=True, text=True,
                         env={**os.environ, "SPARSERL_MALLOC_TUNE": "0"}, timeout=120)
    assert res.returncode == 0 and res.stdout.split()[-2:] == ["False", "False"], res.stderr[-2000:]
