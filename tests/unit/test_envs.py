"""The shipped envs, loaded by path the way the trainer loads them."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sparserl.data.dataset import load_prompts, rows_from_records
from sparserl.utils.envload import load_env
from tests.conftest import EVAL_DATA

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def arithmetic():
    return load_env(str(ROOT / "envs" / "arithmetic.py"))


@pytest.fixture(scope="module")
def math_env():
    return load_env(str(ROOT / "envs" / "math.py"))


def run_step(env, action, answer, **extra):
    return asyncio.run(env.step("prompt text", action, {"answer": answer, **extra}))


def test_arithmetic_prompts_are_deterministic_and_well_formed(arithmetic):
    a = arithmetic.make_prompts(50, seed=0)
    assert a == arithmetic.make_prompts(50, seed=0)
    assert a != arithmetic.make_prompts(50, seed=1)
    assert json.loads(json.dumps(a)) == a  # plain data, like a file's rows
    for row in a:
        (msg,) = row["prompt"]
        assert msg["role"] == "user"
        x, y = (int(t) for t in msg["content"].split("What is ")[1].split("?")[0].split(" + "))
        assert row["answer"] == str(x + y) and 1 <= x <= 9 and 1 <= y <= 9
    rows = rows_from_records(a, "env.make_prompts")
    assert rows[3].answer == a[3]["answer"] and rows[3].prompt == a[3]["prompt"] and rows[3].index == 3
    assert len({r["prompt"][0]["content"] for r in a}) > 20  # varied questions


@pytest.mark.parametrize(
    "action,reward",
    [
        ("12", 1.0),
        ("7 + 5 = 12", 1.0),
        ("The answer is 12.", 1.0),
        ("12 is wrong, it is 13", 0.0),
        ("13", 0.0),
        ("twelve", 0.0),
        ("", 0.0),
        ("}}{{\\boxed{", 0.0),
        ("-12", 0.0),
    ],
)
def test_arithmetic_reward(arithmetic, action, reward):
    out = run_step(arithmetic, action, "12")
    assert out["reward"] == reward and out["score"] == reward and out["done"] is True and out["next_state"] is None


def test_arithmetic_env_metadata(arithmetic):
    assert arithmetic.max_turns == 1 and arithmetic.reset is None and arithmetic.name == "arithmetic"


def test_math_env_on_a_math500_row(math_env):
    rows = load_prompts(str(EVAL_DATA / "math500.jsonl"), prompt_key="problem", key="data.eval_path")
    row = rows[0]  # (3, pi/2) in polar coordinates
    assert row.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    extra = {**row.extra, "answer": row.answer}
    good = asyncio.run(math_env.step("", "So $r=3$, $\\theta=\\pi/2$: \\boxed{(3, \\frac{\\pi}{2})}", extra))
    assert good["reward"] == 1.0 and good["done"] and not good["extra_info"]["verify_timed_out"]
    assert good["extra_info"]["subject"] == row.extra["subject"]
    wrong = asyncio.run(math_env.step("", "\\boxed{(3, \\pi)}", extra))
    assert wrong["reward"] == 0.0
    unboxed = asyncio.run(math_env.step("", "the answer is (3, pi/2)", extra))
    assert unboxed["reward"] == 0.0
    with pytest.raises(KeyError, match="answer_key"):
        asyncio.run(math_env.step("", "\\boxed{1}", {"answer": None}))


def test_math_env_steps_run_concurrently(math_env):
    answers = ["\\frac{1}{2}", "0.5", "2", "\\sqrt{4}"]
    responses = ["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}", "\\boxed{3}", "\\boxed{2}"]

    async def all_steps():
        return await asyncio.gather(*(math_env.step("", r, {"answer": a}) for r, a in zip(responses, answers)))

    assert [o["reward"] for o in asyncio.run(all_steps())] == [1.0, 1.0, 0.0, 1.0]

