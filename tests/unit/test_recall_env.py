"""The recall env (envs/recall.py), loaded by path the way the trainer loads it."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from sparserl.data.dataset import rows_from_records
from sparserl.utils.envload import load_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recall():
    return load_env(str(ROOT / "envs" / "recall.py"))


def run_step(env, action, answer):
    return asyncio.run(env.step("prompt text", action, {"answer": answer}))


def facts_and_question(text: str) -> tuple[dict[str, str], str]:
    facts = dict(re.findall(r"The code for (\w+) is (\d+)\.", text.split("What is")[0]))
    (asked,) = re.findall(r"What is the code for (\w+)\?", text)
    return facts, asked


def test_prompts_are_deterministic_by_seed_and_well_formed(recall):
    a = recall.make_prompts(40, seed=0)
    assert a == recall.make_prompts(40, seed=0)
    assert a != recall.make_prompts(40, seed=1)
    assert json.loads(json.dumps(a)) == a  # plain data, like a file's rows
    m = recall.module
    for row in a:
        (msg,) = row["prompt"]
        assert msg["role"] == "user"
        facts, asked = facts_and_question(msg["content"])
        assert len(facts) == m.NUM_FACTS and len(set(facts.values())) == m.NUM_FACTS
        assert row["key"] == asked and row["answer"] == facts[asked]
        filler = msg["content"].split("\n")[2]
        assert not re.search(r"\d", filler) and not any(k in filler.split() for k in m.KEYS)
        assert sum(s in filler for s in m.FILLER) == m.FILLER_SENTENCES
    assert len({r["answer"] for r in a}) > 20 and len({r["key"] for r in a}) > 6  # varied
    rows = rows_from_records(a, "env.make_prompts")
    assert rows[3].answer == a[3]["answer"] and rows[3].extra == {"key": a[3]["key"]}


def test_prompt_size_knobs(recall):
    short = recall.make_prompts(5, seed=3, num_facts=2, filler_sentences=0)
    long = recall.make_prompts(5, seed=3, num_facts=8, filler_sentences=20)
    for few, many in zip(short, long):
        assert len(facts_and_question(few["prompt"][0]["content"])[0]) == 2
        assert len(facts_and_question(many["prompt"][0]["content"])[0]) == 8
        assert len(many["prompt"][0]["content"]) > len(few["prompt"][0]["content"]) + 500
    with pytest.raises(ValueError, match="filler_sentences"):
        recall.make_prompts(1, seed=0, filler_sentences=10_000)


@pytest.mark.parametrize(
    "action,reward",
    [
        ("The code for red is 17.", 1.0),
        ("17", 1.0),
        ("The code for red is 17. The code for blue is 41.", 1.0),
        ("The code for red is 41.", 0.0),
        ("The code for blue is 41. The code for red is 17.", 0.0),  # listing every code earns nothing
        ("The code for red is N.", 0.0),
        ("seventeen", 0.0),
        ("", 0.0),
        ("-17", 0.0),
        ("The code for red is 170.", 0.0),
    ],
)
def test_reward(recall, action, reward):
    out = run_step(recall, action, "17")
    assert out["reward"] == reward and out["score"] == reward
    assert out["done"] is True and out["next_state"] is None and out["extra_info"] == {"answer": "17"}


def test_step_needs_the_answer(recall):
    with pytest.raises(KeyError, match="answer"):
        asyncio.run(recall.step("s", "17", {}))


def test_sft_examples_score_one_and_differ_from_the_prompts(recall):
    ex = recall.module.make_sft_examples(30, seed=0)
    assert ex == recall.module.make_sft_examples(30, seed=0)
    for row in ex:
        facts, asked = facts_and_question(row["prompt"][0]["content"])
        assert row["answer"] == facts[asked]
        assert row["response"] == f"The code for {asked} is {facts[asked]}."
        assert run_step(recall, row["response"], facts[asked])["reward"] == 1.0
    prompts = {r["prompt"][0]["content"] for r in recall.make_prompts(30, seed=0)}
    assert not prompts & {r["prompt"][0]["content"] for r in ex}  # warm-start data never repeats the RL prompts
