"""Every turn of a multi-turn episode draws from its own trajectory's stream: across the trajectories of a step, no
two draws share a (seed, logical position) key, and no two trajectories share a seed.

A real 3-turn step through `rollout` (the env loop) on the native engine with a tiny random model: each trajectory
samples exactly `M` tokens a turn (`ignore_eos`, no stops; the driver below goes on whatever the finish reason) and
gets `OBS` back, and group g's prompt is `g * (M + len(OBS))` tokens longer than group 0's, so that a later turn of
one group's trajectory sits at the logical positions of the first turn of a later group. The test records what the
engine's draw sees (`engines.draw.sample`: the rows' seeds and positions) and which trajectory each row belongs to.
"""
from __future__ import annotations

import pytest

import sparserl.engines.native.sampler as sampler_module
from sparserl.data.dataset import PromptRow
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.sampler import Sampler
from sparserl.engines.types import SamplingParams
from sparserl.rollout.episode import Opening
from sparserl.rollout.worker import rollout
from sparserl.utils.seed import SAMPLE_MOD, sample_seed, trajectory_index
from tests.conftest import tiny_model

N, GROUPS, TURNS, M = 2, 4, 3, 4
OBS = [7, 9]
ENGINE_SEED = 1234


def _prompt(g: int) -> list[int]:
    # A distinct first token per group, so that no group's prompt is a prefix of another's tokens.
    return [20 + g] + [30] * (7 + g * (M + len(OBS)))


class _Driver:
    """Every trajectory answers exactly TURNS turns, whatever its finish reason; reward 1."""

    async def open(self, rows, prompt_texts, n):
        return [Opening(prompt_ids=_prompt(row.index)) for row in rows for _ in range(n)]

    async def step(self, k, sample, gen, action, last_turn):
        sample.reward = sample.score = 1.0
        return None if last_turn else list(OBS)

    async def close(self, ks):
        return None

    def metrics(self, samples):
        return {}


class _Env:
    max_turns = TURNS

    def driver(self, tokenizer, calls):
        return _Driver()


from tests.unit.test_worker import one_thread  # noqa: E402,F401 - the same autouse fixture: one OpenMP thread


def _record_draws(monkeypatch) -> list[tuple[tuple[int, ...], int, int, int]]:
    """(the row's request prompt, its sample index, the seed and the position the draw keyed it with), per draw."""
    draws, batches = [], []
    real_sample, real_draw = Sampler.sample, sampler_module.sample

    def spy_sample(self, logits, seqs):
        batches.append(seqs)
        try:
            return real_sample(self, logits, seqs)
        finally:
            batches.pop()

    def spy_draw(logits, settings, positions):
        for seq, seed, pos in zip(batches[-1], settings.seeds.tolist(), positions.tolist(), strict=True):
            draws.append((tuple(seq.prompt), seq.sample_index, seed, pos))
        return real_draw(logits, settings, positions)

    monkeypatch.setattr(Sampler, "sample", spy_sample)
    monkeypatch.setattr(sampler_module, "sample", spy_draw)
    return draws


def _owner(samples, prompt: tuple[int, ...], sample_index: int) -> int:
    """The trajectory a draw belongs to: its tokens start with the request's prompt; a first turn's request (the
    group's prompt alone) is told apart from its siblings by the sample index."""
    hits = [k for k, s in enumerate(samples)
            if tuple((s.prompt_ids + s.response_ids)[:len(prompt)]) == prompt
            and (len(prompt) > len(s.prompt_ids) or k % N == sample_index)]
    assert len(hits) == 1, f"a draw of prompt length {len(prompt)} matches trajectories {hits}"
    return hits[0]


@pytest.mark.parametrize("seed, seed_indices", [(None, list(range(GROUPS))), (None, None), (11, list(range(GROUPS)))],
                         ids=["training", "by-position", "eval"])
def test_no_two_trajectories_share_a_draw_key(monkeypatch, tokenizer, seed, seed_indices):
    draws = _record_draws(monkeypatch)
    engine = NativeEngine(tiny_model("llama", vocab=128), tokenizer, num_slots=1024, seed=ENGINE_SEED, eos_token_ids=[])
    rows = [PromptRow(prompt=f"prompt {g}", answer="", index=g) for g in range(GROUPS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=M, n=N, seed=seed, ignore_eos=True)
    samples, _ = rollout(engine, tokenizer, _Env(), rows, [r.prompt for r in rows], params, seed_indices=seed_indices)
    assert [s.num_turns for s in samples] == [TURNS] * GROUPS * N
    assert all(s.turn_lens == [M] * TURNS for s in samples)

    keys: dict[tuple[int, int], set[int]] = {}
    streams: dict[int, set[int]] = {}
    per_trajectory: dict[int, list[int]] = {}
    for prompt, j, s, pos in draws:
        k = _owner(samples, prompt, j)
        keys.setdefault((s, pos), set()).add(k)
        streams.setdefault(s, set()).add(k)
        per_trajectory.setdefault(k, []).append(pos)
    shared_keys = {key: sorted(ks) for key, ks in keys.items() if len(ks) > 1}
    shared_streams = {s: sorted(ks) for s, ks in streams.items() if len(ks) > 1}
    print(f"{len(draws)} draws over {len(samples)} trajectories; {len(shared_keys)} (seed, position) keys and "
          f"{len(shared_streams)} seeds shared across trajectories; first shared keys: "
          f"{sorted(shared_keys.items(), key=lambda kv: kv[0][1])[:4]}")
    # Every sampled token was drawn once, at its own logical position (they only grow inside a trajectory).
    assert sorted(per_trajectory) == list(range(len(samples)))
    for k, positions in per_trajectory.items():
        assert len(positions) == len(set(positions)) == sum(samples[k].loss_mask) == TURNS * M
    assert not shared_keys, f"trajectories drawing with the same (seed, position) keys: {shared_keys}"
    assert not shared_streams, f"trajectories drawing from the same stream: {shared_streams}"
    # Each trajectory draws every turn from its first turn's stream.
    base = ENGINE_SEED if seed is None else seed
    index = seed_indices or list(range(GROUPS))
    assert streams == {sample_seed(base, index[k // N], k % N): {k} for k in range(len(samples))}


def test_trajectory_index_keys_sample_zero_like_the_trajectory():
    """Sample 0 at `trajectory_index(index, sample)` draws from the stream of sample `sample` at `index`, whatever
    the base; sample 0 keeps its index."""
    for base in (0, 5, 2**61 + 3, SAMPLE_MOD - 1):
        for index in (0, 1, 17, 10_006, 2**40 + 9):
            assert trajectory_index(index, 0) == index
            for sample in range(12):
                assert sample_seed(base, trajectory_index(index, sample), 0) == sample_seed(base, index, sample)
                assert 0 <= trajectory_index(index, sample) < SAMPLE_MOD
