"""Partial rollouts (`rollout.partial.*`): a step's generation stops before its longest samples end; they are carried
to the next step and resume under the new weights, beside the step's new prompts; a group (one prompt's `n` samples)
trains once all its samples have ended.

`PartialRollouts` is the rollout call of such a run (what `Rollouts` is otherwise), and holds what is in flight on
this rank: the open groups, each with its ended members (scored) and its carried ones (tokens and per-token sampler
log-probs so far, the step that drew each token, the compaction points). A step (`__call__`):

1. opens the step's new prompts (the env's `reset`, as `rollout.worker` does) as new groups, keyed by the step's
   engine seed and their seed indices;
2. one engine call for every member still going: a new group as one request with `n` samples, a carried member as a
   `GenerationRequest.resume` of its sample (n=1, its group's seed and seed index, its own sample index: the engine
   draws on from the same keyed stream, re-prefilling prompt + tokens under the current weights, a compressed cache
   compacted again where it was), under a `Cutoff`: stop once `finish_frac` of the call's samples have ended, and
   each sample after `max_tokens` new tokens. A member whose group started `max_staleness` steps ago is exempt: it runs
   to its own end in this step, so no token trains more than `max_staleness` steps after the weights that drew it;
3. the members that ended are scored by the env; the stopped ones stay carried;
4. if no group of this rank has ended yet, the carried members go on in another call of the same step (same
   weights), so every step trains on at least one group per rank;
5. the ended groups are returned, oldest first, and leave the state.

Multi-turn episodes (an env module with `max_turns` > 1) are carried too, between turns and inside one. A member
whose turn ended gets the env's answer at once (`env.step` on its own text state, kept per member); with an
observation it goes on to its next turn: in another call of the same step while the step's last call was not cut and
fewer than `finish_frac` of the step's members have ended their episodes (or while a member exempt from the cutoff
still runs), else in the next step. A turn after the first is the synchronous loop's request (rollout/worker.py): the
whole history as its prompt, n=1, keyed by the trajectory's first-turn stream (`utils.seed.trajectory_index`), so
with unchanged weights a carried episode draws the synchronous one's tokens; a turn cut by the cutoff resumes inside
the turn (`Resume` of that turn's tokens). Every turn re-prefills its history (no engine sessions across calls).

Each token keeps the log-prob the sampler drew it with (`Sample.logp_sparse`): the correction's ratio over a carried
sample is then the dense policy of the training step against the weights and cache that drew each token.
`state_dict` / `load_state_dict`: the samples in flight are saved with the run (trainer/partial.py).

Left out on purpose: env objects with their own driver (OpenReward): a carried trajectory would need its remote
session kept across steps (refused at start-up); keeping the KV of a carried sample between steps or turns (the
weights change in between, and held KV would pin the pool); and dropping carried samples (docs/decisions.md).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from sparserl.data.dataset import PromptRow
from sparserl.engines.types import Cutoff, Generation, GenerationRequest, Resume, SamplingParams
from sparserl.rollout.env_module import ModuleDriver
from sparserl.rollout.episode import EnvCalls, Sample
from sparserl.rollout.worker import _fail, _guarded, _Live, _open_lives, rollout_metrics
from sparserl.utils.logging import progress
from sparserl.utils.seed import trajectory_index


@dataclass(frozen=True)
class PartialSettings:
    finish_frac: float = 1.0
    max_tokens: int = 0
    max_staleness: int = 1


@dataclass
class Member:
    """One sample of an open group."""

    sample: Sample
    sample_index: int
    ended: bool = False
    kv_budget: int | None = None  # the compression budget it is drawn under (kept on resume: engines/native/partial.py)
    max_turns: int = 1
    state: str | None = None  # multi-turn: the env's text state after its last turn; None: its group's opening state
    turn_start: int = 0  # response position where its current turn's model tokens begin (0: in its first turn)
    turns_done: int = 0  # turns it has completed (the env answered them)


@dataclass
class OpenGroup:
    """One prompt's samples while some are in flight."""

    members: list[Member]
    state: str  # the env's text state of the prompt (ModuleDriver.states), which scores an ended member
    started: int  # the training step that opened it
    seed: int  # the engine seed of that step: its samples' streams
    seed_index: int

    @property
    def ended(self) -> bool:
        return all(m.ended for m in self.members)


@dataclass
class PartialRollouts:
    """The rollout call of a run with partial rollouts; see the module docstring. `at(step, seed)` binds the step."""

    engine: Any
    tokenizer: Any
    env: Any
    params: SamplingParams
    settings: PartialSettings
    rank: int = 0
    show_progress: bool = True
    max_total_tokens: int | None = None
    step_timeout_s: float | None = None
    max_concurrency: int | None = None
    max_turns: int | None = None  # as `Rollouts`: an env module's own max_turns wins, else this, else 1
    groups: list[OpenGroup] = field(default_factory=list)
    calls: int = 0  # engine calls of the last step (more than one when no group had ended after the first)

    def __post_init__(self) -> None:
        if callable(getattr(self.env, "driver", None)):
            raise ValueError("rollout.partial.enable=true needs an env module: a carried OpenReward episode would need "
                             "its remote session kept across steps")
        self.turns = getattr(self.env, "max_turns", None) or self.max_turns or 1

    def at(self, step: int, seed: int):
        """The `Rollouts`-shaped call of training step `step`, whose engine seed is `seed`."""
        return lambda rows, prompts, seed_indices, label: self.step(step, seed, rows, prompts, seed_indices, label)

    @property
    def in_flight(self) -> int:
        """Samples still going (carried into the next step)."""
        return sum(not m.ended for g in self.groups for m in g.members)

    # ------------------------------------------------------------------------------------------ one step
    def step(self, step: int, seed: int, rows: list[PromptRow], prompts: list[str], seed_indices: list[int],
             label: str) -> tuple[list[Sample], dict[str, float]]:
        base = self.params.seed if self.params.seed is not None else seed
        self.groups += asyncio.run(self._open(rows, prompts, seed_indices, step, base))
        self.calls, going, cut = 0, self.in_flight, False
        with progress(going, label, self.rank, self.show_progress) as bar:
            while self.in_flight and (self.calls == 0 or self._go_on(step, going, cut)):
                cut = self._generate(step, bar)
        done = [g for g in self.groups if g.ended]
        self.groups = [g for g in self.groups if not g.ended]
        samples = [m.sample for g in done for m in g.members]
        for i, s in enumerate(samples):
            s.group = i // self.params.n
        return samples, rollout_metrics(samples)

    def _go_on(self, step: int, going: int, cut: bool) -> bool:
        """Another call in this step: no group of this rank has ended yet; or a member exempt from the cutoff still
        runs; or (multi-turn) the last call ran to its end and fewer than `finish_frac` of the `going` members of the
        step's start have ended their episodes."""
        if not any(g.ended for g in self.groups):
            return True
        if any(step - g.started >= self.settings.max_staleness and not g.ended for g in self.groups):
            return True
        return not cut and going - self.in_flight < self.settings.finish_frac * going

    async def _open(self, rows, prompts, seed_indices, step: int, seed: int) -> list[OpenGroup]:
        if not rows:
            return []
        n = self.params.n
        driver = ModuleDriver(self.env, self.tokenizer, EnvCalls(self.step_timeout_s, self.max_concurrency))
        lives: list[_Live] = _open_lives(rows, await driver.open(rows, prompts, n), n, self.turns)
        groups = []
        for g, index in enumerate(seed_indices):
            members = [Member(lv.sample, lv.sample_index, ended=lv.done, max_turns=lv.max_turns)
                       for lv in lives[g * n: (g + 1) * n]]
            groups.append(OpenGroup(members, driver.states[g * n], step, seed, index))
        for grp in groups:
            if not self._budget(grp) > 0:  # the prompt alone fills the context
                for m in grp.members:
                    if not m.ended:
                        m.sample.finish_reason, m.ended = "length", True
                        _fail(_Live(m.sample, 0, m.sample_index, 1), "truncated")
        return groups

    def _budget(self, group: OpenGroup, member: Member | None = None) -> int:
        """New tokens of a turn: `max_new_tokens`, within the context left after the prompt (and the member's history)."""
        p = self.params.max_new_tokens
        used = len(group.members[0].sample.prompt_ids) + (member.turn_start if member is not None else 0)
        return p if self.max_total_tokens is None else min(p, self.max_total_tokens - used)

    def _requests(self, step: int) -> tuple[list[GenerationRequest], list[list[Member]], frozenset[int]]:
        """This call's requests, the members each one draws for, and the requests exempt from the cutoff."""
        requests, owners, exempt = [], [], set()
        for grp in self.groups:
            going = [m for m in grp.members if not m.ended]
            if not going:
                continue
            params = self.params.replace(seed=grp.seed, max_new_tokens=self._budget(grp))
            old = step - grp.started >= self.settings.max_staleness  # runs to its end in this step
            fresh = all(not m.sample.response_ids for m in grp.members) and grp.started == step and self.calls == 0
            if fresh:  # the group's first call: one request for its n samples, as the synchronous loop sends it
                if old:
                    exempt.add(len(requests))
                requests.append(GenerationRequest(grp.members[0].sample.prompt_ids, params, len(requests),
                                                  seed_index=grp.seed_index))
                owners.append(grp.members)
                continue
            for m in going:
                if old:
                    exempt.add(len(requests))
                requests.append(self._member_request(grp, m, params, len(requests)))
                owners.append([m])
        return requests, owners, frozenset(exempt)

    def _member_request(self, grp: OpenGroup, m: Member, params: SamplingParams, i: int) -> GenerationRequest:
        """A member's request alone: its first turn resumed (its group's request's stream, its own sample index), or
        a later turn, as the synchronous loop sends it, resumed inside the turn where a cutoff stopped it."""
        s, t = m.sample, m.turn_start
        if t == 0:
            resume = Resume(m.sample_index, s.response_ids, s.logp_sparse, s.compressed_at, m.kv_budget)
            return GenerationRequest(s.prompt_ids, params.replace(n=1), i, seed_index=grp.seed_index, resume=resume)
        params = params.replace(n=1, max_new_tokens=self._budget(grp, m))
        resume = None
        if len(s.response_ids) > t:  # stopped inside this turn
            resume = Resume(0, s.response_ids[t:], s.logp_sparse[t:], [c - t for c in s.compressed_at if c >= t],
                            m.kv_budget)
        return GenerationRequest(s.prompt_ids + s.response_ids[:t], params, i,
                                 seed_index=trajectory_index(grp.seed_index, m.sample_index), resume=resume)

    def _generate(self, step: int, bar) -> bool:
        """One engine call for every member still going, then the env's answer to every turn that ended; True when
        the cutoff stopped some of the call's samples."""
        requests, owners, exempt = self._requests(step)
        s = self.settings
        gens = self.engine.generate(requests, progress=bar.update,
                                    cutoff=Cutoff(s.finish_frac, s.max_tokens, exempt))
        self.calls += 1
        by_key = {(g.request_id, g.sample_index): g for g in gens}
        turned: list[tuple[Member, Generation]] = []
        cut = False
        for i, members in enumerate(owners):
            for m in members:
                if m.ended:  # failed at its opening: its draw is not used
                    continue
                gen = by_key[(i, m.sample_index if len(members) > 1 or m.turn_start == 0 else 0)]
                _take(m, gen, step)
                m.kv_budget = gen.kv.kv_budget
                if gen.finish_reason == "abort":
                    cut = True
                else:
                    turned.append((m, gen))
        if turned:
            asyncio.run(self._env_steps(turned, step))
        return cut

    async def _env_steps(self, turned: list[tuple[Member, Generation]], step: int) -> None:
        """The env's answer to each turn that ended: the episode ends (scored), or its observation is appended and
        the member goes on to its next turn (in this step or a later one)."""
        driver = ModuleDriver(self.env, self.tokenizer, EnvCalls(self.step_timeout_s, self.max_concurrency))
        driver.states = [self._state_of(m) for m, _ in turned]
        actions = [self.tokenizer.decode(gen.token_ids, skip_special_tokens=True) for _, gen in turned]
        results = await asyncio.gather(*(_guarded(driver.step(k, m.sample, gen, a, m.sample.num_turns >= m.max_turns))
                                         for k, ((m, gen), a) in enumerate(zip(turned, actions))))
        for k, ((m, _), result) in enumerate(zip(turned, results)):
            s = m.sample
            if isinstance(result, BaseException):
                _fail(_Live(s, 0, m.sample_index, 1), "error")
                m.ended = True
            elif result is None:
                m.ended = True
            elif self.max_total_tokens is not None and \
                    len(s.prompt_ids) + len(s.response_ids) + len(result) >= self.max_total_tokens:
                s.status, m.ended = "truncated", True  # no room left to answer (as rollout/worker.py)
            else:
                s.response_ids += result
                s.loss_mask += [0] * len(result)
                s.logp_sparse += [0.0] * len(result)
                s.drawn_at += [step] * len(result)
                m.state, m.turn_start, m.turns_done = driver.states[k], len(s.response_ids), s.num_turns

    def _state_of(self, member: Member) -> str:
        if member.state is not None:
            return member.state
        return next(g.state for g in self.groups if any(m is member for m in g.members))

    # ------------------------------------------------------------------------------------------ saved state
    def state_dict(self) -> list[dict]:
        return [{"state": g.state, "started": g.started, "seed": g.seed, "seed_index": g.seed_index,
                 "members": [{"sample_index": m.sample_index, "ended": m.ended, "kv_budget": m.kv_budget,
                              "max_turns": m.max_turns, "member_state": m.state, "turn_start": m.turn_start,
                              "turns_done": m.turns_done,
                              "sample": _sample_state(m.sample)} for m in g.members]} for g in self.groups]

    def load_state_dict(self, groups: list[dict]) -> None:
        self.groups = [OpenGroup([Member(_sample_of(m["sample"]), int(m["sample_index"]), bool(m["ended"]),
                                         m.get("kv_budget"), int(m.get("max_turns", 1)), m.get("member_state"),
                                         int(m.get("turn_start", 0)), int(m.get("turns_done", 0)))
                                  for m in g["members"]], str(g["state"]), int(g["started"]), int(g["seed"]),
                                 int(g["seed_index"])) for g in groups]


def _take(member: Member, gen: Generation, step: int) -> None:
    """A member's current turn so far (a resumed one's starts with the tokens it brought), after its history."""
    s, t = member.sample, member.turn_start
    new = t + len(gen.token_ids) - len(s.response_ids)
    s.drawn_at = s.drawn_at[: len(s.response_ids)] + [step] * new
    s.response_ids = s.response_ids[:t] + list(gen.token_ids)
    s.logp_sparse = s.logp_sparse[:t] + [float(x) for x in gen.logp_sparse]
    s.loss_mask = s.loss_mask[:t] + [1] * len(gen.token_ids)
    s.compressed_at = [c for c in s.compressed_at if c < t] + [t + c for c in gen.kv.compressed_at]
    done = member.turns_done
    s.kv = s.kv[:done] + [gen.kv]
    s.turn_lens = s.turn_lens[:done] + [len(gen.token_ids)]
    s.finish_reason = gen.finish_reason
    s.num_turns = done + 1


_SAVED = ("group", "prompt_ids", "response_ids", "loss_mask", "logp_sparse", "reward", "score", "status", "num_turns",
          "finish_reason", "turn_lens", "compressed_at", "extra_info", "drawn_at")


def _sample_state(s: Sample) -> dict:
    return {k: getattr(s, k) for k in _SAVED}


def _sample_of(d: dict) -> Sample:
    return Sample(**{k: d[k] for k in _SAVED})
