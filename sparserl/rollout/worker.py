"""The env loop: prompts -> engine -> env -> (more turns) -> `Sample`s with loss masks and rewards.

Token-in, token-out: a trajectory's tokens are exactly what the engine sampled plus the tokenized env
observations; text is decoded only to hand the env its `action`. Per turn:

1. one engine call for every live trajectory (turn 1: each prompt with `params.n`, which the engine
   expands; later turns: each trajectory alone, n=1, its prompt the full token history);
2. `env.step(state, action, extra_info)` for all of them at once (`asyncio.gather`);
3. a trajectory goes on while the env says not done, `max_turns` is not reached, its turn was not cut by
   `max_new_tokens`, and `max_total_tokens` leaves room; the observation is `next_state` minus the
   `state + action` it must start with, tokenized and appended with loss mask 0 and log-prob 0.

Rewards: a trajectory's reward is the sum of its step rewards, its score the last step's score (default:
its reward). A step that raises, returns a malformed result, or a `next_state` that does not extend
`state + action`, ends the trajectory with reward 0, score 0 and status "error" ("timeout" for a call past
`env.step_timeout_s`); the rest go on and one warning line per distinct error is logged. A turn cut by `max_new_tokens` or the context is still scored
by the env (status "truncated") but not continued. An aborted generation is not scored (reward 0).

Left out on purpose: splitting a trajectory whose `next_state` rewrites history into several sequences,
partial rollouts across steps, and per-token rewards.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sparserl.data.dataset import PromptRow
from sparserl.rollout.engine import RolloutEngine
from sparserl.rollout.types import Generation, GenerationRequest, KVStats, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One trajectory. All samples of a prompt share `group` and sit next to each other."""

    group: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # model and env tokens, in order
    loss_mask: list[int] = field(default_factory=list)  # 1 = model token, 0 = env token
    logp_sparse: list[float] = field(default_factory=list)  # sampler log-probs; 0.0 at env tokens
    reward: float = 0.0
    score: float = 0.0
    status: str = "ok"  # ok | truncated | error | timeout | aborted
    num_turns: int = 0
    finish_reason: str = ""
    kv: list[KVStats] = field(default_factory=list)
    compressed_at: list[int] = field(default_factory=list)  # response positions of the first token after each compression
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Live:
    sample: Sample
    state: str  # conversation text so far, as the env sees it
    sample_index: int
    done: bool = False


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt: the text carries its own special tokens; a BOS is added only where the
    tokenizer normally adds one and the text lacks it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and getattr(tokenizer, "add_bos_token", False) and not text.startswith(bos):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def _check_step_result(result: Any) -> dict[str, Any]:
    if not isinstance(result, dict) or "reward" not in result or "done" not in result:
        raise TypeError(f"env.step must return a dict with at least 'reward' and 'done', got {result!r:.200}")
    return result


class EnvTimeout(Exception):
    """An env call that did not return within `env.step_timeout_s`."""


class _EnvCalls:
    """Env calls under a time limit and a cap on how many run at once (`env.step_timeout_s`, `env.max_concurrency`).

    A call past its limit is cancelled and its sample ends with status "timeout". Only awaiting calls can be
    cancelled: an env that blocks the event loop (sleeps or computes without awaiting) must move that work to
    a thread (`asyncio.to_thread`) for the limit to apply."""

    def __init__(self, timeout_s: float | None, max_concurrency: int | None) -> None:
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.gate = asyncio.Semaphore(max_concurrency) if max_concurrency and max_concurrency > 0 else None

    async def __call__(self, what: str, coro):
        if self.gate is None:
            return await self._timed(what, coro)
        async with self.gate:
            return await self._timed(what, coro)

    async def _timed(self, what: str, coro):
        try:
            return await asyncio.wait_for(coro, self.timeout_s)
        except asyncio.TimeoutError:
            raise EnvTimeout(f"env.{what} did not return within env.step_timeout_s={self.timeout_s:g}") from None


async def _step(calls: _EnvCalls, env, state: str, action: str, extra_info: dict) -> dict[str, Any] | BaseException:
    try:
        return _check_step_result(await calls("step", env.step(state, action, extra_info)))
    except Exception as e:  # noqa: BLE001 - an env bug costs one sample, not the run
        return e


def _generate(engine: RolloutEngine, requests: list[GenerationRequest], counts: list[int]) -> dict[tuple[Any, int], Generation]:
    gens = engine.generate(requests)
    by_key = {(g.request_id, g.sample_index): g for g in gens}
    expected = sum(counts)
    if len(by_key) != expected:
        raise RuntimeError(f"engine returned {len(by_key)} distinct generations for {expected} requested")
    return by_key


def _append_turn(live: _Live, gen: Generation) -> None:
    s = live.sample
    s.compressed_at += [len(s.response_ids) + k for k in gen.kv.compressed_at]
    s.response_ids += gen.token_ids
    s.loss_mask += [1] * len(gen.token_ids)
    s.logp_sparse += [float(x) for x in gen.logp_sparse]
    s.kv.append(gen.kv)
    s.finish_reason = gen.finish_reason
    s.num_turns += 1


def _apply_step(live: _Live, gen: Generation, action: str, result, last_turn: bool, tokenizer, max_total_tokens: int | None) -> bool:
    """Book one env step into the trajectory; True when it goes on to another turn. Raises on env errors."""
    if isinstance(result, BaseException):
        raise result
    s = live.sample
    s.reward += float(result["reward"])
    s.score = float(result.get("score", s.reward))
    if isinstance(result.get("extra_info"), dict):
        s.extra_info = result["extra_info"]
    if gen.finish_reason == "length":
        s.status, live.done = "truncated", True
        return False
    if result["done"] or last_turn:
        live.done = True
        return False
    obs_ids = _observation(tokenizer, live.state + action, result.get("next_state"))
    if max_total_tokens is not None and len(s.prompt_ids) + len(s.response_ids) + len(obs_ids) >= max_total_tokens:
        s.status, live.done = "truncated", True  # no room left for the model to answer the observation
        return False
    s.response_ids += obs_ids
    s.loss_mask += [0] * len(obs_ids)
    s.logp_sparse += [0.0] * len(obs_ids)
    live.state = result["next_state"]
    return True


def _continue_request(live: _Live, i: int, params: SamplingParams, turn: int, max_total_tokens: int | None,
                      seed_index: int | None = None) -> GenerationRequest:
    s = live.sample
    budget = params.max_new_tokens
    if max_total_tokens is not None:
        budget = min(budget, max_total_tokens - len(s.prompt_ids) - len(s.response_ids))
    # Distinct seeds per trajectory and turn, still reproducible from the run's seed; with a seed index the
    # trajectory's own key replaces its position among this turn's survivors.
    seed = None if params.seed is None else params.seed + 1_000_003 * turn + (i if seed_index is None else 0)
    return GenerationRequest(s.prompt_ids + s.response_ids, params.replace(n=1, max_new_tokens=budget, seed=seed), request_id=i,
                             seed_index=seed_index)


def _fail(live: _Live, status: str) -> None:
    live.sample.reward, live.sample.score, live.sample.status, live.done = 0.0, 0.0, status, True


async def rollout_async(
    engine: RolloutEngine,
    tokenizer,
    env,
    rows: list[PromptRow],
    prompt_texts: list[str],
    params: SamplingParams,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    seed_indices: list[int] | None = None,
    step_timeout_s: float | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    if len(rows) != len(prompt_texts):
        raise ValueError(f"{len(rows)} rows but {len(prompt_texts)} prompt texts")
    if seed_indices is not None and len(seed_indices) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(seed_indices)} seed indices")
    max_turns = max_turns or getattr(env, "max_turns", None) or 1
    calls = _EnvCalls(step_timeout_s, max_concurrency)
    reset = getattr(env, "reset", None)
    if reset is not None:  # once per prompt: all n samples of a group start from the same state
        starts = await asyncio.gather(*(calls("reset", reset(copy.deepcopy(_extra(r)))) for r in rows), return_exceptions=True)
        failed_resets = {g: e for g, e in enumerate(starts) if isinstance(e, BaseException)}
        for e in {f"{type(e).__name__}: {e}" for e in failed_resets.values()}:
            log.warning("env.reset failed: %s", e[:300])
        prompt_texts = [t if s is None or isinstance(s, BaseException) else s for t, s in zip(prompt_texts, starts)]
    else:
        failed_resets = {}

    lives: list[_Live] = []
    requests: list[GenerationRequest] = []
    for g, (row, text) in enumerate(zip(rows, prompt_texts)):
        ids = encode_text(tokenizer, text)
        budget = params.max_new_tokens if max_total_tokens is None else min(params.max_new_tokens, max_total_tokens - len(ids))
        group = [_Live(Sample(group=g, prompt_ids=ids, extra_info=copy.deepcopy(_extra(row))), text, k) for k in range(params.n)]
        lives += group
        if g in failed_resets:  # the episode never started: no generation, reward 0
            for lv in group:
                _fail(lv, "timeout" if isinstance(failed_resets[g], EnvTimeout) else "error")
            continue
        if budget <= 0:  # the prompt alone fills the context
            for lv in group:
                lv.sample.finish_reason = "length"
                _fail(lv, "truncated")
            continue
        requests.append(GenerationRequest(ids, params.replace(max_new_tokens=budget), request_id=g,
                                          seed_index=None if seed_indices is None else seed_indices[g]))

    # Turn 1 keys generations by (prompt, sample); later turns by (trajectory, 0).
    by_key = _generate(engine, requests, [r.params.n for r in requests]) if requests else {}
    active = [(lv, by_key[(lv.sample.group, lv.sample_index)]) for lv in lives if not lv.done]
    turn = 1
    while active:
        for lv, gen in active:
            _append_turn(lv, gen)
        scored = [(lv, gen) for lv, gen in active if gen.finish_reason != "abort"]
        for lv, gen in active:
            if gen.finish_reason == "abort":
                _fail(lv, "aborted")
        actions = [tokenizer.decode(gen.token_ids, skip_special_tokens=True) for _, gen in scored]
        results = await asyncio.gather(*(_step(calls, env, lv.state, a, lv.sample.extra_info) for (lv, _), a in zip(scored, actions)))

        errors: Counter[str] = Counter()
        going_on: list[_Live] = []
        for (lv, gen), action, result in zip(scored, actions, results):
            try:
                if _apply_step(lv, gen, action, result, turn >= max_turns, tokenizer, max_total_tokens):
                    going_on.append(lv)
            except Exception as e:  # noqa: BLE001 - an env bug costs one sample, not the run
                errors[f"{type(e).__name__}: {e}"] += 1
                _fail(lv, "timeout" if isinstance(e, EnvTimeout) else "error")
        for message, count in errors.items():
            log.warning("env.step failed on %d sample(s) at turn %d: %s", count, turn, message[:300])

        turn += 1
        requests = [_continue_request(lv, i, params, turn, max_total_tokens,
                                      None if seed_indices is None else seed_indices[lv.sample.group] * params.n + lv.sample_index)
                    for i, lv in enumerate(going_on)]
        by_key = _generate(engine, requests, [1] * len(requests)) if requests else {}
        active = [(lv, by_key[(i, 0)]) for i, lv in enumerate(going_on)]

    samples = [lv.sample for lv in lives]
    return samples, rollout_metrics(samples)


def _extra(row: PromptRow) -> dict[str, Any]:
    return {**row.extra, "answer": row.answer, "index": row.index}


def _observation(tokenizer, prefix: str, next_state: Any) -> list[int]:
    if not isinstance(next_state, str):
        raise TypeError(f"env.step returned done=False but next_state={next_state!r:.80} is not a string")
    if not next_state.startswith(prefix):
        raise ValueError("env.step returned a next_state that does not start with state + action")
    return tokenizer.encode(next_state[len(prefix) :], add_special_tokens=False)


def rollout(
    engine: RolloutEngine,
    tokenizer,
    env,
    rows: list[PromptRow],
    prompt_texts: list[str],
    params: SamplingParams,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    seed_indices: list[int] | None = None,
    step_timeout_s: float | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """Roll out this rank's prompts (`params.n` samples each) through `env`; see the module docstring.
    `max_turns=None` takes the env's `max_turns` (or 1). `seed_indices` (one per row) key each prompt's
    sampling streams instead of its position here, so a prompt draws the same samples however the prompts
    are split across ranks. `step_timeout_s` and `max_concurrency` bound the env calls (`_EnvCalls`). Runs its
    own event loop; inside a running loop await `rollout_async` instead."""
    return asyncio.run(rollout_async(engine, tokenizer, env, rows, prompt_texts, params, max_turns, max_total_tokens,
                                     seed_indices, step_timeout_s, max_concurrency))


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    n = len(samples)
    if n == 0:
        return {}
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / n
    lens = [len(s.response_ids) for s in samples]
    frac = lambda status: sum(s.status == status for s in samples) / n  # noqa: E731
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "score/mean": sum(s.score for s in samples) / n,
        "env/error_frac": frac("error"),
        "env/aborted_frac": frac("aborted"),
        "env/timeout_frac": frac("timeout"),
        "env/turns_mean": sum(s.num_turns for s in samples) / n,
        "response/len_mean": sum(lens) / n,
        "response/len_max": float(max(lens)),
        "response/model_tokens_mean": sum(sum(s.loss_mask) for s in samples) / n,
        "response/truncated_frac": frac("truncated"),
    }
