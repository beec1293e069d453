"""The rescue of rejected samples (sparserl/trainer/rescue.py, `algo.correction.rescue=dense`): which samples are
re-rolled and with which seeds, the splice by hand (groups keep their size and order), the native engine's dense
generation inside a compressing engine, and one `Rescue.run` on a tiny random model's real rollouts."""
import pytest
import torch

from sparserl.algo.correction import correct
from sparserl.algo.correction_config import CorrectionConfig
from sparserl.config import AlgoConfig
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.kv import KVPolicyConfig
from sparserl.rollout.episode import Sample
from sparserl.trainer.dynamic_sampling import round_seed
from sparserl.trainer.rescue import (Redraw, Rescue, logp_rows, pick, rejected_sequences, rescue_seed,
                                     rescue_seed_index, splice)
from sparserl.trainer.train_batch import to_train_batch
from tests.conftest import tiny_model

KV = KVPolicyConfig(algorithm="rkv", budget=6, window=2, divide_length=4, kernel=3, compress_prompt=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]


def _sample(group: int, tag: int, length: int = 3, reward: float = 0.0) -> Sample:
    return Sample(group=group, prompt_ids=[1, 2], response_ids=[tag] * length, loss_mask=[1] * length,
                  logp_sparse=[-1.0] * length, reward=reward)


# ------------------------------------------------------------------------------------------ decisions by hand
def test_pick_re_rolls_the_rejected_samples_with_their_own_seeds():
    keys = [(1, 4), (1, 5), (2, 0)]  # three groups of n=2: round 1 places 4 and 5, round 2 place 0
    redraws = pick([False, True, True, True, False, False], keys, n=2)
    assert [(r.index, r.key, r.sample) for r in redraws] == [(1, (1, 4), 1), (2, (1, 5), 0), (3, (1, 5), 1)]
    assert [r.seed_index for r in redraws] == [rescue_seed_index((1, 4), 1, 2), rescue_seed_index((1, 5), 0, 2),
                                               rescue_seed_index((1, 5), 1, 2)]
    # A sample's seed index is its global place (round, prompt place * n + sample): the same on any rank split.
    indices = {rescue_seed_index((r, p), j, 4) for r in (1, 2, 3) for p in range(64) for j in range(4)}
    assert len(indices) == 3 * 64 * 4
    assert pick(torch.zeros(6, dtype=torch.bool), keys, n=2) == []
    with pytest.raises(AssertionError):
        pick([True] * 5, keys, n=2)


def test_pick_re_rolls_whole_groups_past_the_share():
    keys = [(1, 0), (1, 1), (1, 2)]  # three groups of n=4
    rejected = [True, False, False, False,  # 1 of 4: only the rejected one
                True, True, False, False,  # 2 of 4 = 0.5: the whole group
                True, True, True, False]  # 3 of 4: the whole group
    redraws = pick(rejected, keys, n=4, group_frac=0.5)
    assert [r.index for r in redraws] == [0, 4, 5, 6, 7, 8, 9, 10, 11]
    assert [(r.key, r.sample) for r in redraws][1:5] == [((1, 1), j) for j in range(4)]
    assert [r.seed_index for r in redraws] == [rescue_seed_index(keys[r.index // 4], r.index % 4, 4) for r in redraws]
    assert [r.index for r in pick(rejected, keys, n=4, group_frac=0.75)] == [0, 4, 5, 8, 9, 10, 11]
    assert [r.index for r in pick(rejected, keys, n=4)] == [i for i, f in enumerate(rejected) if f]  # 0 = off
    assert [r.index for r in pick(rejected, keys, n=4, group_frac=1.0)] == [0, 4, 5, 8, 9, 10]  # none all rejected
    assert pick([False] * 12, keys, n=4, group_frac=0.25) == []  # no rejected sample, no redraw


def test_the_rescue_seed_is_apart_from_every_rounds():
    for step in (1, 2, 7):
        rounds = {round_seed(3, step, r) for r in range(1, 200)}
        assert rescue_seed(3, step) not in rounds
    assert len({rescue_seed(3, s) for s in range(1, 100)}) == 99 and rescue_seed(3, 1) != rescue_seed(4, 1)


def test_splice_puts_each_redraw_in_its_place_and_groups_keep_their_size_and_order():
    samples = [_sample(g, 10 * g + j) for g in range(3) for j in range(2)]  # groups 0, 1, 2 of n=2
    rows = [torch.full((3,), -float(i)) for i in range(6)]
    redraws = [Redraw(1, (1, 0), 1, 0), Redraw(4, (1, 2), 0, 0)]
    new = [_sample(99, 7, length=5), _sample(99, 8, length=2)]
    new_rows = [torch.full((5,), 0.5), torch.full((2,), 0.25)]
    out, out_rows = splice(samples, rows, redraws, new, new_rows)
    assert [s.group for s in out] == [0, 0, 1, 1, 2, 2]
    assert [s.response_ids[0] for s in out] == [0, 7, 10, 11, 8, 21]
    assert out[1] is new[0] and out[4] is new[1] and out_rows[1] is new_rows[0] and out_rows[4] is new_rows[1]
    assert all(out[i] is samples[i] and out_rows[i] is rows[i] for i in (0, 2, 3, 5))
    assert [s.response_ids[0] for s in samples] == [0, 1, 10, 11, 20, 21]  # the input lists are left as they were
    # The rescued rows end up in the batch as its logp_old, each sample's own length.
    batch = to_train_batch(out, "cpu", logp_old=out_rows)
    assert batch.logp_old.shape == (6, 5)
    assert torch.equal(batch.logp_old[1], torch.full((5,), 0.5))
    assert torch.equal(batch.logp_old[4], torch.tensor([0.25, 0.25, 0.0, 0.0, 0.0]))
    assert torch.equal(batch.logp_old[0], torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0]))
    # Rows are cut from a padded (B, T) tensor at each sample's length.
    assert [r.tolist() for r in logp_rows(batch.logp_old, out)][:2] == [[0.0, 0.0, 0.0], [0.5] * 5]


def test_rejected_sequences_are_the_ones_correct_rejects():
    torch.manual_seed(0)
    samples = [_sample(g, 1, length=4) for g in range(4)]
    batch = to_train_batch(samples, "cpu")
    batch.logp_old = batch.logp_sparse + 0.01 * torch.randn(4, 4)
    batch.logp_old[1, 2] = -30.0  # vetoed
    batch.logp_old[3] = batch.logp_sparse[3] - 0.3  # geometric mean e^-0.3 < 0.8
    cfg = CorrectionConfig(geo_low=0.8)
    assert rejected_sequences(cfg, batch).tolist() == [False, True, False, True]
    corr, _ = correct(cfg, batch.logp_old, batch.logp_sparse, batch.mask)
    assert torch.equal(rejected_sequences(cfg, batch), corr.seq_rejected)


def test_nothing_happens_when_off_or_nothing_is_rejected():
    samples = [_sample(g, 1) for g in range(2) for _ in range(2)]
    batch = to_train_batch(samples, "cpu")
    batch.logp_old = batch.logp_sparse.clone()
    fail = lambda *a: pytest.fail("no redraw expected")  # noqa: E731
    off = Rescue(AlgoConfig(), 2, None, "cpu")  # the run's default: the correction off, rescue none
    assert not off.enabled and off.run(samples, batch, [(1, 0), (1, 1)], fail, fail, _NoTimer()).metrics == {}
    algo = AlgoConfig(correction=CorrectionConfig(rescue="dense"))
    out = Rescue(algo, 2, None, "cpu").run(samples, batch, [(1, 0), (1, 1)], fail, fail, _NoTimer())
    assert out.samples is samples and out.batch is batch
    assert out.metrics == {"rescue/seqs": 0.0, "rescue/frac": 0.0, "rescue/rejected_before_frac": 0.0}


class _NoTimer:
    entered = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------------------ real components
def _engine(kv, seed=5):
    return NativeEngine(tiny_model("llama", seed=1), num_slots=2048, eos_token_ids=[], kv=kv, seed=seed)


def _generate(engine, n=2, max_new=24, seed_indices=None):
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=n)
    requests = [GenerationRequest(p, params, i, seed_index=None if seed_indices is None else seed_indices[i])
                for i, p in enumerate(PROMPTS)]
    return engine.generate(requests)


def test_dense_generation_of_a_compressing_engine_is_a_dense_engines():
    dense = _generate(_engine(None))
    engine = _engine(KV)
    sparse = _generate(engine)
    assert engine.stats().compressions > 0
    with engine.dense():
        inside = _generate(engine)
        assert engine.compression is None
    assert engine.stats().compressions == sum(g.kv.compressions for g in sparse)  # none inside the block
    for d, g in zip(dense, inside):
        assert d.token_ids == g.token_ids and g.kv.compressions == 0
        assert max(abs(a - b) for a, b in zip(d.logp_sparse, g.logp_sparse)) < 1e-5
    assert any(s.token_ids != d.token_ids for s, d in zip(sparse, dense))  # compression changed some draws
    # After the block the engine compresses again, exactly as before it.
    again = _generate(engine)
    assert [g.token_ids for g in again] == [g.token_ids for g in sparse]
    assert all(a.kv.compressions == b.kv.compressions for a, b in zip(again, sparse))


def test_a_dense_generation_that_the_pool_cannot_hold_names_the_dense_worst_case():
    engine = NativeEngine(tiny_model("llama", seed=1), num_slots=24, eos_token_ids=[], kv=KV)
    params = SamplingParams(max_new_tokens=40)
    assert len(engine.generate([GenerationRequest(PROMPTS[0], params)])[0].token_ids) == 40  # compressed: fits
    with engine.dense(), pytest.raises(ValueError, match=r"needs up to 47 KV slots.*dense generation"):
        engine.generate([GenerationRequest(PROMPTS[0], params)])
    assert engine.compression is not None


def _dense_logprobs(model):
    """logp_old of a batch: the model's own forward over prompt + response, fp32, temperature 1."""
    def run(batch):
        out = torch.zeros_like(batch.mask)
        for i, (ids, p) in enumerate(zip(batch.ids, batch.prompt_lens)):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()  # (L, V)
            logp = torch.log_softmax(logits[p - 1: len(ids) - 1], -1)
            out[i, : len(ids) - p] = logp.gather(-1, torch.tensor(ids[p:])[:, None])[:, 0]
        return out
    return run


def _to_samples(gens, n):
    return [Sample(group=k // n, prompt_ids=list(g.prompt_token_ids), response_ids=list(g.token_ids),
                   loss_mask=[1] * len(g.token_ids), logp_sparse=list(g.logp_sparse), reward=float(k % 2))
            for k, g in enumerate(gens)]


def test_rescue_run_replaces_the_rejected_samples_with_dense_redraws():
    n = 2
    engine = _engine(KV)
    model = engine.runner.model
    samples = _to_samples(_generate(engine, n=n), n)
    dense_logprobs = _dense_logprobs(model)
    batch = to_train_batch(samples, "cpu")
    batch.logp_old = dense_logprobs(batch)
    # A bound tight enough that some compressed samples fail it (their geometric-mean log xi runs from -0.008 to
    # 0.018 here) and dense ones (xi = 1 up to fp32 noise) pass.
    cfg = CorrectionConfig(geo_low=0.999, veto=None, token_low=None, token_high=None)
    before = rejected_sequences(cfg, batch)
    assert 0 < int(before.sum()) < len(samples), before
    keys = [(1, 10 + g) for g in range(len(PROMPTS))]
    calls = []

    def redraw(redraws):
        calls.append(redraws)
        engine.set_seed(rescue_seed(0, 1))
        with engine.dense():
            gens = [engine.generate([GenerationRequest(samples[r.index].prompt_ids,
                                                       SamplingParams(max_new_tokens=24), r.index,
                                                       seed_index=r.seed_index)])[0] for r in redraws]
        return [Sample(group=-1, prompt_ids=list(g.prompt_token_ids), response_ids=list(g.token_ids),
                       loss_mask=[1] * len(g.token_ids), logp_sparse=list(g.logp_sparse), reward=1.0) for g in gens]

    timer = _NoTimer()
    out = Rescue(AlgoConfig(correction=CorrectionConfig(**{**vars(cfg), "rescue": "dense"})), n, None,
                 "cpu").run(samples, batch, keys, redraw, dense_logprobs, timer)
    picked = [i for i, r in enumerate(before.tolist()) if r]
    assert [r.index for r in calls[0]] == picked and timer.entered == 1
    assert out.metrics["rescue/seqs"] == len(picked) and out.metrics["rescue/frac"] == len(picked) / len(samples)
    assert out.metrics["rescue/rejected_before_frac"] == len(picked) / len(samples)
    assert out.metrics["rescue/reward_mean"] == 1.0
    # Groups keep their size and order; the accepted samples are the same objects with the same logp_old.
    assert [s.group for s in out.samples] == [k // n for k in range(len(samples))]
    assert all(out.samples[i] is samples[i] for i in range(len(samples)) if i not in picked)
    assert all(out.samples[i] is not samples[i] and out.samples[i].prompt_ids == samples[i].prompt_ids for i in picked)
    for i, s in enumerate(out.samples):
        T = len(s.response_ids)
        if i in picked:  # the redraw's dense logp_old, which its sampler matches: xi = 1 up to numerics
            assert torch.allclose(out.batch.logp_old[i, :T], torch.tensor(s.logp_sparse), atol=1e-5)
        else:
            assert torch.equal(out.batch.logp_old[i, :T], batch.logp_old[i, :T])
    assert not rejected_sequences(cfg, out.batch).any()


def test_rescue_run_re_rolls_a_mostly_rejected_group_whole():
    n = 2
    engine = _engine(KV)
    samples = _to_samples(_generate(engine, n=n), n)
    dense_logprobs = _dense_logprobs(engine.runner.model)
    batch = to_train_batch(samples, "cpu")
    batch.logp_old = dense_logprobs(batch)
    cfg = CorrectionConfig(geo_low=0.999, veto=None, token_low=None, token_high=None, rescue="dense",
                           rescue_group_frac=0.5)
    before = rejected_sequences(cfg, batch).tolist()
    whole = [g for g in range(len(PROMPTS)) if any(before[g * n: (g + 1) * n])]  # half of n=2 reaches the share
    assert whole and sum(before) < len(whole) * n, before  # some group has an accepted sample to re-roll too
    calls = []

    def redraw(redraws):
        calls.append(redraws)
        with engine.dense():
            gens = [engine.generate([GenerationRequest(samples[r.index].prompt_ids, SamplingParams(max_new_tokens=24),
                                                       r.index, seed_index=r.seed_index)])[0] for r in redraws]
        return [Sample(group=-1, prompt_ids=list(g.prompt_token_ids), response_ids=list(g.token_ids),
                       loss_mask=[1] * len(g.token_ids), logp_sparse=list(g.logp_sparse), reward=0.5) for g in gens]

    out = Rescue(AlgoConfig(correction=cfg), n, None, "cpu").run(samples, batch, [(1, g) for g in range(len(PROMPTS))],
                                                                 redraw, dense_logprobs, _NoTimer())
    picked = [g * n + j for g in whole for j in range(n)]
    assert [r.index for r in calls[0]] == picked
    assert out.metrics["rescue/seqs"] == len(picked)
    assert out.metrics["rescue/rejected_before_frac"] == sum(before) / len(samples)  # the rejected, not the redrawn
    assert all((out.samples[i] is samples[i]) == (i not in picked) for i in range(len(samples)))
    assert not rejected_sequences(cfg, out.batch).any()
