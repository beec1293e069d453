"""The cycle-walk env (envs/cycle_walk.py), loaded by path the way the trainer loads it."""
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
def walk_env():
    return load_env(str(ROOT / "envs" / "cycle_walk.py"))


def stated_links(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^(\w+) -> (\w+)$", text, flags=re.M)


def test_prompts_are_deterministic_and_state_one_cycle(walk_env):
    m = walk_env.module
    rows = walk_env.make_prompts(20, seed=0)
    assert rows == walk_env.make_prompts(20, seed=0) and rows != walk_env.make_prompts(20, seed=1)
    assert json.loads(json.dumps(rows)) == rows
    for row in rows:
        (msg,) = row["prompt"]
        stated, walk = stated_links(msg["content"]), row["answer"].split()
        links = dict(stated)
        assert len(stated) == len(links) == len(set(links.values())) == m.NUM_LINKS  # a permutation of the words
        assert len(walk) == m.NUM_STEPS + 1
        assert all(links[a] == b for a, b in zip(walk, walk[1:]))  # the walk follows the stated links
        assert len(set(walk[:m.NUM_LINKS])) == m.NUM_LINKS and walk[m.NUM_LINKS] == walk[0]  # one cycle through all
        assert f"from {walk[0]} for {m.NUM_STEPS} steps" in msg["content"]
        laps = [list(zip(walk, walk[1:]))[i:i + m.NUM_LINKS] for i in range(m.NUM_LINKS)]
        assert stated not in laps  # never stated in walking order, from any start
    assert len({r["answer"].split()[0] for r in rows}) > 10
    assert rows_from_records(rows, "env.make_prompts")[2].answer == rows[2]["answer"]


def test_sizes_are_arguments_and_checked(walk_env):
    m = walk_env.module
    (row,) = m.make_prompts(1, seed=4, num_links=3, num_steps=7)
    walk = row["answer"].split()
    assert len(walk) == 8 and walk[0] == walk[3] == walk[6] and len(set(walk)) == 3
    with pytest.raises(ValueError, match="num_links"):
        m.make_prompts(1, seed=0, num_links=2)
    with pytest.raises(ValueError, match="num_links"):
        m.make_prompts(1, seed=0, num_links=len(m.WORDS) + 1)
    with pytest.raises(ValueError, match="num_steps"):
        m.make_sft_examples(1, seed=0, num_steps=0)


def test_sft_examples_walk_the_cycle_and_differ_from_prompts(walk_env):
    m = walk_env.module
    examples = m.make_sft_examples(10, seed=0)
    prompts = {r["prompt"][0]["content"] for r in walk_env.make_prompts(200, seed=0)}
    for ex in examples:
        assert ex["prompt"][0]["content"] not in prompts
        assert m.score(ex["response"], ex["answer"]) == 1.0
        assert m.extract_answer(ex["response"]) == ex["answer"]
        lines = ex["response"].splitlines()
        assert len(lines) == m.NUM_STEPS and lines[0].startswith("1. ") and lines[-1].startswith(f"{m.NUM_STEPS}. ")
    assert len(m.make_sft_examples(3, seed=0, num_steps=5)[0]["response"].splitlines()) == 5


def test_sizes_with_the_real_tokenizer(walk_env, tokenizer):
    m = walk_env.module
    for w in m.WORDS:  # one token at a line start and after a space: every link has the same shape
        assert len(tokenizer.encode(w, add_special_tokens=False)) == 1, w
        assert len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1, w
    for e in m.make_sft_examples(4, seed=3):
        text = tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=False)
        prompt = len(tokenizer.encode(text, add_special_tokens=False))
        response = len(tokenizer.encode(e["response"], add_special_tokens=False))
        assert prompt <= 80 and response >= 4 * 64  # the point of the task: the response is most of the KV
        assert prompt <= 0.2 * (prompt + response + 1)


ANSWER = "fox cup owl fox cup"  # a loop of 3 walked for 4 steps


@pytest.mark.parametrize(
    "response,reward",
    [
        ("1. fox -> cup\n2. cup -> owl\n3. owl -> fox\n4. fox -> cup", 1.0),
        ("fox -> cup\ncup -> owl\n\nowl -> fox\nfox -> cup\n", 1.0),  # numbers optional, blank lines skipped
        ("1. fox -> cup\n2. cup -> owl\n3. owl -> fox\n4. fox -> cup\n5. cup -> owl", 1.0),  # extra lines ignored
        ("1. fox -> cup\n2. cup -> owl\n3. owl -> fox\n4. fox -> owl", 0.75),  # wrong at the last step
        ("1. fox -> cup\n2. cup -> owl\n3. owl -> cup\n4. cup -> owl", 0.5),  # wrong at step 3
        ("1. fox -> cup\n2. cup -> fox\n3. owl -> fox\n4. fox -> cup", 0.25),  # nothing after the first mistake
        ("1. fox -> cup\nso then\n3. owl -> fox", 0.25),  # a line that does not parse is a mistake
        ("Here is the walk:\n1. fox -> cup\n2. cup -> owl", 0.0),
        ("1. fox -> cup -> owl\n2. cup -> owl", 0.0),
        ("2. cup -> owl\n3. owl -> fox", 0.0),  # starting elsewhere on the loop is a different walk
        ("", 0.0),
    ],
)
def test_reward_is_the_correct_prefix(walk_env, response, reward):
    out = asyncio.run(walk_env.step("prompt", response, {"answer": ANSWER}))
    assert out["reward"] == pytest.approx(reward) and out["score"] == out["reward"] and out["done"]


def test_partial_credit_has_one_level_per_step(walk_env):
    m = walk_env.module
    (row,) = m.make_prompts(1, seed=2)
    lines = m.target_response(row["answer"].split()).splitlines()
    rewards = [m.score("\n".join(lines[:k]), row["answer"]) for k in range(m.NUM_STEPS + 1)]
    assert rewards == [k / m.NUM_STEPS for k in range(m.NUM_STEPS + 1)]


def test_extract_answer_and_missing_answer(walk_env):
    m = walk_env.module
    assert m.extract_answer("1. fox -> cup\n2. cup -> owl\noops\n3. owl -> fox") == "fox cup owl"
    assert m.extract_answer("no walk here") is None
    with pytest.raises(KeyError, match="answer"):
        asyncio.run(walk_env.step("prompt", "1. fox -> cup", {}))
