"""Env modules (`env.path`, sparserl/utils/envload.py) in the rollout loop: `ModuleDriver`.

`reset` once per prompt (all `n` samples of a group start from the same state; a string replaces the prompt
text), then `env.step(state, action, extra_info)` on conversation text each turn. A trajectory's reward is the
sum of its step rewards, its score the last step's score (default: its reward). The observation is
`next_state` minus the `state + action` it must start with, tokenized. A turn cut by `max_new_tokens` is still
scored (status "truncated") but not continued.

Left out on purpose: sessions and tools (those envs are OpenReward envs, openreward/).
"""
from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

from sparserl.data.dataset import PromptRow
from sparserl.rollout.episode import EnvCalls, Opening, Sample, encode_text, failure_status, row_extra
from sparserl.engines.types import Generation

log = logging.getLogger("sparserl.rollout.worker")  # its warnings read as the env loop's


def _check_step_result(result: Any) -> dict[str, Any]:
    if not isinstance(result, dict) or "reward" not in result or "done" not in result:
        raise TypeError(f"env.step must return a dict with at least 'reward' and 'done', got {result!r:.200}")
    return result


class ModuleDriver:
    """An env module (`sparserl/utils/envload.py`): text states, `reset` per prompt, `step` per turn."""

    def __init__(self, env, tokenizer, calls: EnvCalls) -> None:
        self.env, self.tokenizer, self.calls = env, tokenizer, calls
        self.states: list[str] = []

    async def open(self, rows: list[PromptRow], prompt_texts: list[str], n: int) -> list[Opening]:
        reset = getattr(self.env, "reset", None)
        failed: dict[int, BaseException] = {}
        if reset is not None:  # once per prompt: all n samples of a group start from the same state
            starts = await asyncio.gather(*(self.calls("reset", reset(copy.deepcopy(row_extra(r)))) for r in rows),
                                          return_exceptions=True)
            failed = {g: e for g, e in enumerate(starts) if isinstance(e, BaseException)}
            for e in {f"{type(e).__name__}: {e}" for e in failed.values()}:
                log.warning("env.reset failed: %s", e[:300])
            prompt_texts = [t if s is None or isinstance(s, BaseException) else s for t, s in zip(prompt_texts, starts)]
        self.states = [text for text in prompt_texts for _ in range(n)]
        out = []
        for g, text in enumerate(prompt_texts):
            ids = encode_text(self.tokenizer, text)
            status = failure_status(failed[g]) if g in failed else None
            out += [Opening(ids, status) for _ in range(n)]
        return out

    async def step(self, k: int, sample: Sample, gen: Generation, action: str, last_turn: bool) -> list[int] | None:
        result = _check_step_result(await self.calls("step", self.env.step(self.states[k], action, sample.extra_info)))
        sample.reward += float(result["reward"])
        sample.score = float(result.get("score", sample.reward))
        if isinstance(result.get("extra_info"), dict):
            sample.extra_info = result["extra_info"]
        if gen.finish_reason == "length":
            sample.status = "truncated"
            return None
        if result["done"] or last_turn:
            return None
        obs_ids = _observation(self.tokenizer, self.states[k] + action, result.get("next_state"))
        self.states[k] = result["next_state"]
        return obs_ids

    async def close(self, ks: list[int] | None) -> None:
        return None

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        return {}


def _observation(tokenizer, prefix: str, next_state: Any) -> list[int]:
    if not isinstance(next_state, str):
        raise TypeError(f"env.step returned done=False but next_state={next_state!r:.80} is not a string")
    if not next_state.startswith(prefix):
        raise ValueError("env.step returned a next_state that does not start with state + action")
    return tokenizer.encode(next_state[len(prefix) :], add_special_tokens=False)
