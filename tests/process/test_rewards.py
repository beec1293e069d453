"""Math-verify checking in the worker processes of `CheckPool`, including the hard time limit (the answer extraction
is tests/unit/test_answer_extract.py)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from sparserl.rewards.math import CheckPool, averify_answer, verify_answer


def _sleep_then(seconds: float, value):
    time.sleep(seconds)
    return value


def _raise(message: str):
    raise ValueError(message)


@pytest.fixture(scope="module")
def pool():
    p = CheckPool(max_workers=2)
    yield p
    p.close()


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("so it is \\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{\\dfrac{2}{4}}", "\\frac12", True),
        ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("\\boxed{18}", "18", True),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
        ("\\boxed{19}", "18", False),
        ("the answer is 18", "18", False),  # boxed-only: no box, no reward
    ],
)
def test_verify_answer_equivalences(pool, response, answer, expected):
    assert verify_answer(response, answer, timeout_s=20, pool=pool) is expected


def test_verify_in_threads_and_async(pool):
    """signal-based timeouts would fail outside the main thread; the pool does not care."""
    out = []
    t = threading.Thread(target=lambda: out.append(verify_answer("\\boxed{2/4}", "1/2", timeout_s=20, pool=pool)))
    t.start()
    t.join()
    assert out == [True]

    async def many():
        return await asyncio.gather(*(averify_answer(f"\\boxed{{{k}}}", "3", 20, pool) for k in range(4)))

    assert asyncio.run(many()) == [False, False, False, True]


def test_timeout_returns_none_fast_and_pool_recovers(pool):
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        pool.call(_sleep_then, (30, True), timeout_s=0.3)
    assert time.perf_counter() - t0 < 3
    assert pool.call(_sleep_then, (0, "alive"), timeout_s=30) == "alive"  # a fresh worker replaced the killed one
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        pool.call(_raise, ("boom",), timeout_s=30)


def test_pathological_answer_times_out(pool, caplog):
    """A real slow check: math-verify/sympy evaluating a tower of powers. The step gets None in time."""
    pool.call(_sleep_then, (0, None), timeout_s=30)  # make sure a worker is up: the deadline covers the check only
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        assert verify_answer("\\boxed{9^{9^{9^{9}}}}", "1", timeout_s=0.5, pool=pool) is None
    assert time.perf_counter() - t0 < 4
    assert "timed out after 0.5 s" in caplog.text
    assert verify_answer("\\boxed{1}", "1", timeout_s=20, pool=pool) is True


def test_default_pool_works_without_an_importable_main():
    """Workers are fresh interpreters, so a parent run from `python -c` (or stdin, or torchrun) is fine."""
    code = "from sparserl.rewards.math import verify_answer; print(verify_answer('so \\\\boxed{0.25}', '\\\\frac{1}{4}'))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
