"""The env loop: prompts -> engine -> env -> (more turns) -> `Sample`s with loss masks and rewards.

Token-in, token-out: a trajectory's tokens are exactly what the engine sampled plus the tokenized env
observations; text is decoded only to hand the env its `action`. Per turn:

1. one engine call for every live trajectory (turn 1: each prompt with `params.n`, which the engine
   expands; later turns: each trajectory alone, n=1, its prompt the full token history, drawing from its first
   turn's stream at the positions that follow: no two trajectories of a step share a stream);
2. one env step for each of them at once (`asyncio.gather`);
3. a trajectory goes on while the env says not done, its `max_turns` is not reached, its turn was not cut by
   `max_new_tokens`, and `max_total_tokens` leaves room; the observation is appended with loss mask 0 and
   log-prob 0.

Two kinds of env drive step 2 through one small interface (`EnvDriver`: open, step, close):

- an env module (`env.path`, `ModuleDriver` in env_module.py): `reset` once per prompt, then `env.step(state, action,
  extra_info)` on conversation text; the observation is `next_state` minus the `state + action` it must
  start with, tokenized. A trajectory's reward is the sum of its step rewards, its score the last step's
  score (default: its reward). A turn cut by `max_new_tokens` or the context is still scored (status
  "truncated") but not continued.
- an env object with a `driver(tokenizer, calls)` method, such as the OpenReward envs
  (`sparserl/rollout/openreward/`): one session per trajectory, opened before turn 1 and closed when the
  trajectory ends, on every path (done, truncated, error, timeout, abort, or an exception out of this loop).
  The driver renders the prompt and the observation tokens and books the reward itself.

On an engine with sessions (`supports_sessions`, the native engine) each trajectory's KV cache is kept between
its turns (`keep_session`; the key is `Generation.session_id`), so a turn prefills only the observation and its
last token; the request still carries the whole history, so engines without sessions sample the same. The keys
still held when the rollout ends are released (`engine.end_sessions`), on every path.

A step that raises, returns a malformed result, or a `next_state` that does not extend `state + action`,
ends the trajectory with reward 0, score 0 and status "error" ("timeout" for an env call past
`env.step_timeout_s`); the rest go on and one warning line per distinct error is logged. An aborted
generation is not scored (reward 0). The `n` trajectories of a prompt must open with the same prompt tokens
(they are sampled as one group); one that does not ends with status "error".

`Rollouts` is the call the trainer's rounds, the rescue's redraws and the evaluation make: the run's settings bound
once, this rank's prompts, seed indices and a progress label per call.

Left out on purpose: splitting a trajectory whose `next_state` rewrites history into several sequences,
partial rollouts across steps (rollout/partial.py carries
single-turn samples), and per-token rewards.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sparserl.data.dataset import PromptRow
from sparserl.engines.protocol import RolloutEngine, supports_sessions
from sparserl.rollout.env_module import ModuleDriver
from sparserl.rollout.episode import EnvCalls, EnvDriver, Opening, Sample, failure_status, row_extra
from sparserl.engines.types import Generation, GenerationRequest, SamplingParams
from sparserl.utils.logging import progress
from sparserl.utils.seed import trajectory_index

log = logging.getLogger(__name__)


@dataclass
class _Live:
    sample: Sample
    k: int  # trajectory index, row-major
    sample_index: int
    max_turns: int
    done: bool = False
    session: Any = None  # the engine's key for this trajectory's held KV (engines with sessions), else None
    seed_index: int | None = None  # keys its later turns' draws with its first turn's stream (set at turn 1)


async def _guarded(coro):
    try:
        return await coro
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
    s.turn_lens.append(len(gen.token_ids))
    s.finish_reason = gen.finish_reason
    s.num_turns += 1


def _append_observation(live: _Live, obs_ids: list[int], max_total_tokens: int | None) -> bool:
    """Append env tokens; False (status truncated) when they leave the model no room to answer."""
    s = live.sample
    if max_total_tokens is not None and len(s.prompt_ids) + len(s.response_ids) + len(obs_ids) >= max_total_tokens:
        s.status, live.done = "truncated", True
        return False
    s.response_ids += obs_ids
    s.loss_mask += [0] * len(obs_ids)
    s.logp_sparse += [0.0] * len(obs_ids)
    return True


def _continue_request(live: _Live, i: int, params: SamplingParams, turn: int, max_total_tokens: int | None) -> GenerationRequest:
    s = live.sample
    budget = params.max_new_tokens
    if max_total_tokens is not None:
        budget = min(budget, max_total_tokens - len(s.prompt_ids) - len(s.response_ids))
    # Every turn draws from the trajectory's own first-turn stream (the request seed, or the engine's, and its seed
    # index as sample 0: `utils.seed.trajectory_index`); its logical positions only grow, so no two draws of a step
    # share a (seed, position) key, and a trajectory's draws do not depend on which others are still going.
    # The engine continues the trajectory's held KV (if it kept it) and keeps it again unless this is the last turn.
    keep = live.session is not None and turn < live.max_turns
    return GenerationRequest(s.prompt_ids + s.response_ids, params.replace(n=1, max_new_tokens=budget), request_id=i,
                             seed_index=live.seed_index, session_id=live.session, keep_session=keep)


def _fail(live: _Live, status: str) -> None:
    live.sample.reward, live.sample.score, live.sample.status, live.done = 0.0, 0.0, status, True


def _open_lives(rows: list[PromptRow], openings: list[Opening], n: int, max_turns: int) -> list[_Live]:
    """One `_Live` per opening; a group's prompt is its first open trajectory's, and a sibling that opened with
    other tokens is failed (the engine samples a group from one prompt)."""
    if len(openings) != len(rows) * n:
        raise RuntimeError(f"env opened {len(openings)} trajectories for {len(rows)} prompts x {n} samples")
    lives, mismatched = [], 0
    for g, row in enumerate(rows):
        group = openings[g * n : (g + 1) * n]
        ref = next((o.prompt_ids for o in group if o.status is None), group[0].prompt_ids)
        for j, o in enumerate(group):
            lv = _Live(Sample(group=g, prompt_ids=list(ref), extra_info=copy.deepcopy(row_extra(row))), g * n + j, j,
                       o.max_turns or max_turns)
            if o.status is not None:
                _fail(lv, o.status)
            elif o.prompt_ids != ref:
                mismatched += 1
                _fail(lv, "error")
            lives.append(lv)
    for e in sorted({o.error for o in openings if o.status is not None and o.error}):
        log.warning("env failed to open a trajectory: %s", e[:300])
    if mismatched:
        log.warning("%d trajectories opened with a different prompt than the first sample of their group: failed", mismatched)
    return lives


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
    max_turns = getattr(env, "max_turns", None) or max_turns or 1  # an env module's own max_turns wins (env.max_turns' help)
    calls = EnvCalls(step_timeout_s, max_concurrency)
    driver: EnvDriver = env.driver(tokenizer, calls) if callable(getattr(env, "driver", None)) else ModuleDriver(env, tokenizer, calls)
    lives: list[_Live] = []
    try:
        lives = _open_lives(rows, await driver.open(rows, prompt_texts, params.n), params.n, max_turns)
        await _run_turns(engine, tokenizer, driver, lives, params, max_total_tokens, seed_indices)
    finally:  # every path, an exception out of the engine included, releases what the env and the engine hold
        await driver.close(None)
        held = [lv.session for lv in lives if lv.session is not None]
        if held:
            engine.end_sessions(held)
    samples = [lv.sample for lv in lives]
    return samples, rollout_metrics(samples) | driver.metrics(samples)


async def _run_turns(engine: RolloutEngine, tokenizer, driver: EnvDriver, lives: list[_Live], params: SamplingParams,
                     max_total_tokens: int | None, seed_indices: list[int] | None) -> None:
    n, sessions = params.n, supports_sessions(engine)
    requests: list[GenerationRequest] = []
    for g in range(len(lives) // n):
        group = lives[g * n : (g + 1) * n]
        if all(lv.done for lv in group):  # the episode never started: no generation, reward 0
            continue
        ids = group[0].sample.prompt_ids
        budget = params.max_new_tokens if max_total_tokens is None else min(params.max_new_tokens, max_total_tokens - len(ids))
        if budget <= 0:  # the prompt alone fills the context
            for lv in group:
                if not lv.done:
                    lv.sample.finish_reason = "length"
                    _fail(lv, "truncated")
            continue
        # Engines with sessions keep each sample's KV for its next turn (`keep_session`); others ignore the key.
        keep = sessions and max(lv.max_turns for lv in group) > 1
        # The engine keys this request's samples by its seed index, else its place in `requests`.
        index = len(requests) if seed_indices is None else seed_indices[g]
        for lv in group:
            lv.seed_index = trajectory_index(index, lv.sample_index)
        requests.append(GenerationRequest(ids, params.replace(max_new_tokens=budget), request_id=g,
                                          seed_index=None if seed_indices is None else seed_indices[g],
                                          session_id=("rollout", g) if keep else None, keep_session=keep))

    # Turn 1 keys generations by (prompt, sample); later turns by (trajectory, 0).
    by_key = _generate(engine, requests, [r.params.n for r in requests]) if requests else {}
    active = [(lv, by_key[(lv.sample.group, lv.sample_index)]) for lv in lives if not lv.done]
    turn = 1
    while active:
        for lv, gen in active:
            _append_turn(lv, gen)
            lv.session = gen.session_id if sessions else None
        scored = [(lv, gen) for lv, gen in active if gen.finish_reason != "abort"]
        for lv, gen in active:
            if gen.finish_reason == "abort":
                _fail(lv, "aborted")
        actions = [tokenizer.decode(gen.token_ids, skip_special_tokens=True) for _, gen in scored]
        results = await asyncio.gather(*(_guarded(driver.step(lv.k, lv.sample, gen, a, turn >= lv.max_turns))
                                         for (lv, gen), a in zip(scored, actions)))

        errors: Counter[str] = Counter()
        going_on: list[_Live] = []
        for (lv, _), result in zip(scored, results):
            if isinstance(result, BaseException):
                errors[f"{type(result).__name__}: {result}"] += 1
                _fail(lv, failure_status(result))
            elif result is None:
                lv.done = True
            elif _append_observation(lv, result, max_total_tokens):
                going_on.append(lv)
        for message, count in errors.items():
            log.warning("env.step failed on %d sample(s) at turn %d: %s", count, turn, message[:300])
        await driver.close([lv.k for lv, _ in active if lv.done])

        turn += 1
        requests = [_continue_request(lv, i, params, turn, max_total_tokens) for i, lv in enumerate(going_on)]
        by_key = _generate(engine, requests, [1] * len(requests)) if requests else {}
        active = [(lv, by_key[(i, 0)]) for i, lv in enumerate(going_on)]


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
    `max_turns=None` takes the env's `max_turns` (or 1); a driver's trajectories may carry their own.
    `seed_indices` (one per row) key each prompt's sampling streams instead of its position here, so a
    prompt draws the same samples however the prompts are split across ranks. `step_timeout_s` and
    `max_concurrency` bound the env calls (`EnvCalls`). Runs its own event loop; inside a running loop await
    `rollout_async` instead."""
    return asyncio.run(rollout_async(engine, tokenizer, env, rows, prompt_texts, params, max_turns, max_total_tokens,
                                     seed_indices, step_timeout_s, max_concurrency))


class ProgressEngine:
    """The engine, with each finished sequence advancing a progress bar (multi-turn sessions pass through)."""

    def __init__(self, engine, bar) -> None:
        self.engine, self.bar = engine, bar
        self.supports_sessions = supports_sessions(engine)

    def generate(self, requests, progress=None):
        return self.engine.generate(requests, progress=self.bar.update)

    def end_sessions(self, session_ids=None):
        return self.engine.end_sessions(session_ids)


@dataclass(frozen=True)
class Rollouts:
    """The one rollout call of the training step, the rescue's redraws and the evaluation: built once from the
    run's settings (`from_config`), then called with this rank's rows, their prompt texts, their seed indices and
    a label for the progress bar (rank 0, `logger.progress`). No rows: no samples, no metrics, no engine call."""

    engine: Any
    tokenizer: Any
    env: Any
    params: SamplingParams
    rank: int = 0
    show_progress: bool = True
    lines_every_s: float = 0.0  # > 0: a plain progress line that often where bars are off (utils.logging.progress)
    max_turns: int | None = None
    max_total_tokens: int | None = None
    step_timeout_s: float | None = None
    max_concurrency: int | None = None

    @classmethod
    def from_config(cls, cfg, engine, tokenizer, env, params: SamplingParams, rank: int, **settings) -> Rollouts:
        """With the run's env-call bounds (`env.step_timeout_s`, `env.max_concurrency`) and progress setting."""
        return cls(engine, tokenizer, env, params, rank, cfg.logger.progress, step_timeout_s=cfg.env.step_timeout_s,
                   max_concurrency=cfg.env.max_concurrency, **settings)

    def __call__(self, rows: list[PromptRow], prompts: list[str], seed_indices: list[int], label: str,
                 n: int | None = None) -> tuple[list[Sample], dict[str, float]]:
        """`n`: samples per prompt in place of `params.n` (the rescue draws one)."""
        if not rows:
            return [], {}
        params = self.params if n is None else self.params.replace(n=n)
        with progress(len(rows) * params.n, label, self.rank, self.show_progress, self.lines_every_s) as bar:
            return rollout(ProgressEngine(self.engine, bar), self.tokenizer, self.env, rows, prompts, params, self.max_turns,
                           self.max_total_tokens, seed_indices, self.step_timeout_s, self.max_concurrency)


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
