"""The long-chain env (envs/long_chain.py), loaded by path the way the trainer loads it."""
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
def chain_env():
    return load_env(str(ROOT / "envs" / "long_chain.py"))


def links_of(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+) -> (\w+)$", text, flags=re.M))


def test_prompts_are_deterministic_and_state_one_chain(chain_env):
    m = chain_env.module
    rows = chain_env.make_prompts(20, seed=0)
    assert rows == chain_env.make_prompts(20, seed=0) and rows != chain_env.make_prompts(20, seed=1)
    assert json.loads(json.dumps(rows)) == rows
    for row in rows:
        (msg,) = row["prompt"]
        links, chain = links_of(msg["content"]), row["answer"].split()
        assert len(links) == m.NUM_LINKS and len(chain) == m.NUM_LINKS + 1 == len(set(chain))
        assert all(links[a] == b for a, b in zip(chain, chain[1:]))  # the prompt's links are the chain's
        assert f"Start at {chain[0]} and follow all {m.NUM_LINKS} links" in msg["content"]
        stated = [a for a in re.findall(r"^(\w+) ->", msg["content"], flags=re.M)]
        assert stated != chain[:-1]  # stated in another order than they are needed
    assert len({r["answer"].split()[0] for r in rows}) > 10
    assert rows_from_records(rows, "env.make_prompts")[2].answer == rows[2]["answer"]


def test_sft_examples_walk_the_chain_and_differ_from_prompts(chain_env):
    m = chain_env.module
    examples = m.make_sft_examples(10, seed=0)
    prompts = {r["prompt"][0]["content"] for r in chain_env.make_prompts(200, seed=0)}
    for ex in examples:
        assert ex["prompt"][0]["content"] not in prompts
        assert m.score(ex["response"], ex["answer"]) == 1.0
        assert m.extract_answer(ex["response"]) == ex["answer"]
        lines = ex["response"].splitlines()
        assert len(lines) == m.NUM_LINKS and lines[0].startswith("1. ") and lines[-1].startswith(f"{m.NUM_LINKS}. ")
    assert len(m.make_sft_examples(3, seed=0, num_links=5)[0]["response"].splitlines()) == 5
    with pytest.raises(ValueError, match="num_links"):
        m.make_prompts(1, seed=0, num_links=len(m.WORDS))


def test_sizes_with_the_real_tokenizer(chain_env, tokenizer):
    m = chain_env.module
    for w in m.WORDS:  # one token at a line start and after a space: every link has the same shape
        assert len(tokenizer.encode(w, add_special_tokens=False)) == 1, w
        assert len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1, w
    ex = m.make_sft_examples(4, seed=3)
    for e in ex:
        response = len(tokenizer.encode(e["response"], add_special_tokens=False))
        prompt = len(tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=False))
        assert response >= 200  # the point of the task
        assert prompt > 500  # characters: the whole chain is in the prompt


ANSWER = "fox cup map owl bee"  # 4 links


@pytest.mark.parametrize(
    "response,reward",
    [
        ("1. fox -> cup\n2. cup -> map\n3. map -> owl\n4. owl -> bee", 1.0),
        ("fox -> cup\ncup -> map\n\nmap -> owl\nowl -> bee\n", 1.0),  # numbers optional, blank lines skipped
        ("1. fox -> cup\n2. cup -> map\n3. map -> owl\n4. owl -> bee\n5. bee -> ant", 1.0),  # extra lines ignored
        ("1. fox -> cup\n2. cup -> map\n3. map -> bee\n4. bee -> owl", 0.5),  # wrong at line 3
        ("1. fox -> cup\n2. cup -> owl\n3. map -> owl\n4. owl -> bee", 0.25),  # nothing after the first mistake
        ("Here is the chain:\n1. fox -> cup\n2. cup -> map", 0.0),  # a line that does not parse is a mistake
        ("1. fox -> cup", 0.25),
        ("2. cup -> map\n3. map -> owl", 0.0),
        ("", 0.0),
    ],
)
def test_reward_is_the_correct_prefix(chain_env, response, reward):
    out = asyncio.run(chain_env.step("prompt", response, {"answer": ANSWER}))
    assert out["reward"] == pytest.approx(reward) and out["score"] == out["reward"] and out["done"]


def test_extract_answer_and_missing_answer(chain_env):
    m = chain_env.module
    assert m.extract_answer("1. fox -> cup\n2. cup -> map\noops\n3. map -> owl") == "fox cup map"
    assert m.extract_answer("no chain here") is None
    with pytest.raises(KeyError, match="answer"):
        asyncio.run(chain_env.step("prompt", "1. fox -> cup", {}))
