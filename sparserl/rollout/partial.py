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

Each token keeps the log-prob the sampler drew it with (`Sample.logp_sparse`): the correction's ratio over a carried
sample is then the dense policy of the training step against the weights and cache that drew each token.
`state_dict` / `load_state_dict`: the samples in flight are saved with the run (trainer/partial.py).

Left out on purpose: multi-turn episodes and env objects with their own driver (OpenReward): a carried trajectory
would need its env session kept across steps (refused at start-up); keeping the KV of a carried sample between steps
(the weights change in between, and held KV would pin the pool); and dropping carried samples (docs/decisions.md).
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
    groups: list[OpenGroup] = field(default_factory=list)
    calls: int = 0  # engine calls of the last step (more than one when no group had ended after the first)

    def __post_init__(self) -> None:
        turns = getattr(self.env, "max_turns", None) or 1
        if callable(getattr(self.env, "driver", None)) or turns > 1:
            raise ValueError("rollout.partial.enable=true needs a single-turn env module: a carried multi-turn or "
                             "OpenReward episode would need its env session kept across steps")

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
        self.calls = 0
        with progress(self.in_flight, label, self.rank, self.show_progress) as bar:
            while self.in_flight and (self.calls == 0 or not any(g.ended for g in self.groups)):
                self._generate(step, bar)
        done = [g for g in self.groups if g.ended]
        self.groups = [g for g in self.groups if not g.ended]
        samples = [m.sample for g in done for m in g.members]
        for i, s in enumerate(samples):
            s.group = i // self.params.n
        return samples, rollout_metrics(samples)

    async def _open(self, rows, prompts, seed_indices, step: int, seed: int) -> list[OpenGroup]:
        if not rows:
            return []
        n = self.params.n
        driver = ModuleDriver(self.env, self.tokenizer, EnvCalls(self.step_timeout_s, self.max_concurrency))
        lives: list[_Live] = _open_lives(rows, await driver.open(rows, prompts, n), n, 1)
        groups = []
        for g, index in enumerate(seed_indices):
            members = [Member(lv.sample, lv.sample_index, ended=lv.done) for lv in lives[g * n: (g + 1) * n]]
            groups.append(OpenGroup(members, driver.states[g * n], step, seed, index))
        for grp in groups:
            if not self._budget(grp) > 0:  # the prompt alone fills the context
                for m in grp.members:
                    if not m.ended:
                        m.sample.finish_reason, m.ended = "length", True
                        _fail(_Live(m.sample, 0, m.sample_index, 1), "truncated")
        return groups

    def _budget(self, group: OpenGroup) -> int:
        p = self.params.max_new_tokens
        return p if self.max_total_tokens is None else min(p, self.max_total_tokens - len(group.members[0].sample.prompt_ids))

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
                s = m.sample
                if old:
                    exempt.add(len(requests))
                resume = Resume(m.sample_index, s.response_ids, s.logp_sparse, s.compressed_at, m.kv_budget)
                requests.append(GenerationRequest(s.prompt_ids, params.replace(n=1), len(requests),
                                                  seed_index=grp.seed_index, resume=resume))
                owners.append([m])
        return requests, owners, frozenset(exempt)

    def _generate(self, step: int, bar) -> None:
        requests, owners, exempt = self._requests(step)
        s = self.settings
        gens = self.engine.generate(requests, progress=bar.update,
                                    cutoff=Cutoff(s.finish_frac, s.max_tokens, exempt))
        self.calls += 1
        by_key = {(g.request_id, g.sample_index): g for g in gens}
        ended: list[tuple[Member, Generation]] = []
        for i, members in enumerate(owners):
            for m in members:
                if m.ended:  # failed at its opening: its draw is not used
                    continue
                gen = by_key[(i, m.sample_index)]
                _take(m.sample, gen, step)
                m.kv_budget = gen.kv.kv_budget
                if gen.finish_reason != "abort":
                    m.ended = True
                    ended.append((m, gen))
        if ended:
            asyncio.run(self._score(ended))

    async def _score(self, ended: list[tuple[Member, Generation]]) -> None:
        driver = ModuleDriver(self.env, self.tokenizer, EnvCalls(self.step_timeout_s, self.max_concurrency))
        driver.states = [self._state_of(m) for m, _ in ended]
        actions = [self.tokenizer.decode(gen.token_ids, skip_special_tokens=True) for _, gen in ended]
        results = await asyncio.gather(*(_guarded(driver.step(k, m.sample, gen, a, True))
                                         for k, ((m, gen), a) in enumerate(zip(ended, actions))))
        for (m, _), result in zip(ended, results):
            if isinstance(result, BaseException):
                _fail(_Live(m.sample, 0, m.sample_index, 1), "error")

    def _state_of(self, member: Member) -> str:
        return next(g.state for g in self.groups if any(m is member for m in g.members))

    # ------------------------------------------------------------------------------------------ saved state
    def state_dict(self) -> list[dict]:
        return [{"state": g.state, "started": g.started, "seed": g.seed, "seed_index": g.seed_index,
                 "members": [{"sample_index": m.sample_index, "ended": m.ended, "kv_budget": m.kv_budget,
                              "sample": _sample_state(m.sample)} for m in g.members]} for g in self.groups]

    def load_state_dict(self, groups: list[dict]) -> None:
        self.groups = [OpenGroup([Member(_sample_of(m["sample"]), int(m["sample_index"]), bool(m["ended"]),
                                         m.get("kv_budget"))
                                  for m in g["members"]], str(g["state"]), int(g["started"]), int(g["seed"]),
                                 int(g["seed_index"])) for g in groups]


def _take(sample: Sample, gen: Generation, step: int) -> None:
    """A member's generation so far (a resumed one's starts with the tokens it brought)."""
    new = len(gen.token_ids) - len(sample.response_ids)
    sample.drawn_at += [step] * new
    sample.response_ids = list(gen.token_ids)
    sample.logp_sparse = [float(x) for x in gen.logp_sparse]
    sample.loss_mask = [1] * len(gen.token_ids)
    sample.compressed_at = list(gen.kv.compressed_at)
    sample.kv = [gen.kv]
    sample.turn_lens = [len(gen.token_ids)]
    sample.finish_reason = gen.finish_reason
    sample.num_turns = 1


_SAVED = ("group", "prompt_ids", "response_ids", "loss_mask", "logp_sparse", "reward", "score", "status", "num_turns",
          "finish_reason", "turn_lens", "compressed_at", "extra_info", "drawn_at")


def _sample_state(s: Sample) -> dict:
    return {k: getattr(s, k) for k in _SAVED}


def _sample_of(d: dict) -> Sample:
    return Sample(**{k: d[k] for k in _SAVED})
