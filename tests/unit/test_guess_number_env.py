"""envs/guess_number.py, the multi-turn example env: its rules, and its episodes through the real env loop."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sparserl.data.dataset import PromptRow, format_prompt
from sparserl.engines.types import SamplingParams
from sparserl.rollout.worker import rollout
from sparserl.utils.envload import load_env
from tests.unit.test_worker import ForwardEngine, model, one_thread  # noqa: F401 (module fixtures)

ROOT = Path(__file__).resolve().parents[2]
CHATML = "<|im_start|>user\nGuess.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def env():
    return load_env(str(ROOT / "envs" / "guess_number.py"))


def step(env, state, action, **info):
    return asyncio.run(env.step(state, action, info))


def test_prompts_are_deterministic_and_in_range(env):
    rows = env.make_prompts(40, seed=3)
    assert rows == env.make_prompts(40, seed=3) and rows != env.make_prompts(40, seed=4)
    assert {int(r["answer"]) for r in rows} <= set(range(env.module.LOW, env.module.HIGH + 1))
    assert env.max_turns == 4 and env.name == "guess_number"


def test_hints_point_to_the_number_and_the_reward_decays_with_turns(env):
    info = {"answer": "7", "index": 0}
    low = step(env, CHATML, "I guess 3", **info)
    assert low["done"] is False and low["reward"] == 0.0 and low["extra_info"] == {**info, "turn": 1}
    assert low["next_state"] == CHATML + "I guess 3" + "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    assert info == {"answer": "7", "index": 0}  # the row's dict is not mutated: the group's samples share it
    high = step(env, low["next_state"], "9", **low["extra_info"])
    assert high["next_state"].endswith("user\nLower.<|im_end|>\n<|im_start|>assistant\n")
    right = step(env, high["next_state"], "It is 7", **high["extra_info"])
    assert right["done"] and right["reward"] == right["score"] == pytest.approx(0.6)  # found at turn 3
    assert step(env, CHATML, "7", answer="7")["reward"] == 1.0
    none = step(env, CHATML, "no idea", answer="7")
    assert none["next_state"].endswith("user\nAnswer with just a number.<|im_end|>\n<|im_start|>assistant\n")
    last = step(env, CHATML, "2", answer="7", turn=3)  # the 4th wrong guess ends the episode at 0
    assert last["done"] and last["reward"] == 0.0 and last["next_state"] is None
    with pytest.raises(KeyError, match="answer"):
        step(env, CHATML, "7")


def test_the_user_turn_follows_the_prompt_s_chat_format(env):
    llama = "<|start_header_id|>user<|end_header_id|>\n\nGuess.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert env.module.user_turn(llama, "Lower.") == ("<|start_header_id|>user<|end_header_id|>\n\nLower.<|eot_id|>"
                                                     "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert env.module.user_turn("Guess a number.", "Lower.") == "\nUser: Lower.\nAssistant:"


def test_episodes_through_the_env_loop_mask_the_hints_and_use_the_env_s_turns(env, tokenizer, model):  # noqa: F811
    rows = [PromptRow(prompt=r["prompt"], answer=r["answer"], extra={}, index=i)
            for i, r in enumerate(env.make_prompts(3, seed=0))]
    texts = [format_prompt(r, tokenizer) for r in rows]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1, stop_strings=("e",))
    # max_turns=1 is what the trainer passes by default (env.max_turns): the module's own max_turns wins.
    samples, metrics = rollout(ForwardEngine(model, tokenizer), tokenizer, env, rows, texts, params, max_turns=1)
    assert metrics["env/error_frac"] == 0.0
    multi = [s for s in samples if s.num_turns > 1]
    assert multi, "no episode reached a second turn"
    for s in samples:
        assert 1 <= s.num_turns <= env.max_turns and s.reward == s.score
        assert any(s.reward == pytest.approx(r) for r in (0.0, 1.0, 0.8, 0.6, 0.4))
        hints = s.num_turns - 1  # every turn but the last ends in an observation, masked out of the loss
        assert sum(1 for a, b in zip([1] + s.loss_mask, s.loss_mask) if a == 1 and b == 0) == hints
    s = multi[0]
    first = s.response_ids[s.loss_mask.index(0):]
    hint_ids = tokenizer.encode("\n<|im_start|>user\n", add_special_tokens=False)
    assert first[: len(hint_ids)] == hint_ids
    assert metrics["env/turns_mean"] == pytest.approx(sum(x.num_turns for x in samples) / len(samples))
