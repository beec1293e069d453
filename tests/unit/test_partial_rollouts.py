"""Partial rollouts through the env loop (sparserl/rollout/partial.py) on a tiny random model, in process: with the
weights unchanged a carried sample is the one an uninterrupted (synchronous) rollout draws, dense and compressed;
`max_staleness` bounds every token's age; the samples in flight survive a save and load; the correction's ratio over
a carried sample uses each token's own sampler log-prob."""
import io
from pathlib import Path

import pytest
import torch

from sparserl.algo.correction import explain
from sparserl.algo.correction_config import CorrectionConfig
from sparserl.data.dataset import PromptRow
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import SamplingParams
from sparserl.kv import KVPolicyConfig
from sparserl.rollout.partial import PartialRollouts, PartialSettings
from sparserl.trainer.train_batch import to_train_batch
from sparserl.utils.envload import load_env
from tests.conftest import byte_tokenizer_dir, tiny_model

ROOT = Path(__file__).resolve().parents[2]
RKV = KVPolicyConfig(algorithm="rkv", budget=16, window=4, divide_length=6, kernel=3)
# The tiny model draws these bytes now and then: responses end anywhere from a few tokens to the cap.
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, stop_token_ids=(40, 41, 42, 43))
LOGP_TOL = 1e-5  # a re-prefilled cache moves later log-probs by float32 ulps (test_partial_engine.py)


ENV = load_env(str(ROOT / "envs" / "long_tail.py")).module


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(byte_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def prompts(first: int, count: int):
    rows = ENV.make_prompts(first + count, seed=1)[first:]
    return ([PromptRow(r["prompt"][0]["content"], r["answer"], {"target_len": r["target_len"]}, first + i)
             for i, r in enumerate(rows)], [r["prompt"][0]["content"][:24] for r in rows])


def rollouts(tok, kv=None, model=None, params=PARAMS, **settings):
    engine = NativeEngine(model or tiny_model("llama", vocab=len(tok)), tok, num_slots=4096, kv=kv)
    return PartialRollouts(engine, tok, ENV, params, PartialSettings(**settings), show_progress=False)


def run(partial: PartialRollouts, steps: int, new_prompts: dict[int, tuple[int, int]], done=None):
    """Steps 1..steps (each with engine seed 100 + step); `new_prompts[step]` = (first row, count). Returns every
    trained sample by (row index, sample index), and the step it trained in."""
    done = {} if done is None else done
    for step in range(1, steps + 1):
        rows, texts = prompts(*new_prompts[step]) if step in new_prompts else ([], [])
        samples, _ = partial.at(step, 100 + step)(rows, texts, [r.index for r in rows], "test")
        for i, s in enumerate(samples):
            done[(s.extra_info["index"], i % PARAMS.n)] = (s, step)
    return done


def same(a, b):
    assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason and a.reward == b.reward
    assert max(abs(x - y) for x, y in zip(a.logp_sparse, b.logp_sparse)) < LOGP_TOL
    assert a.compressed_at == b.compressed_at


@pytest.mark.parametrize("kv", [None, RKV], ids=["dense", "rkv"])
def test_carried_samples_with_unchanged_weights_are_the_synchronous_ones(tok, kv):
    plan = {1: (0, 4), 2: (4, 4)}
    sync = run(rollouts(tok, kv, max_staleness=0), 2, plan)
    partial = rollouts(tok, kv, finish_frac=0.5, max_tokens=5, max_staleness=5)
    got = run(partial, 6, plan)
    assert partial.in_flight == 0 and set(got) == set(sync) and len(got) == 16
    spans = [max(s.drawn_at) - min(s.drawn_at) for s, _ in got.values() if s.drawn_at]
    assert sum(span > 0 for span in spans) >= 4  # samples crossed a step boundary
    for key, (s, _) in got.items():
        same(s, sync[key][0])
    assert partial.engine.pool.num_used == 0


def test_the_staleness_bound(tok):
    plan = {step: (4 * (step - 1), 4) for step in range(1, 6)}
    partial = rollouts(tok, finish_frac=0.25, max_tokens=3, max_staleness=1)
    got = run(partial, 5, plan)
    ages = [step - min(s.drawn_at) for s, step in got.values() if s.drawn_at]
    assert max(ages) == 1  # carried, once at most
    assert partial.in_flight == 0 or all(5 - g.started <= 1 for g in partial.groups)
    never = rollouts(tok, finish_frac=0.25, max_tokens=3, max_staleness=0)
    for step in range(1, 3):
        rows, texts = prompts(4 * (step - 1), 4)
        samples, _ = never.at(step, 100 + step)(rows, texts, [r.index for r in rows], "test")
        assert len(samples) == 8 and never.in_flight == 0 and all(set(s.drawn_at) == {step} for s in samples)


def test_samples_in_flight_resume_from_a_saved_state(tok, tmp_path):
    plan = {1: (0, 4), 2: (4, 4)}
    settings = dict(finish_frac=0.5, max_tokens=5, max_staleness=6)
    whole = run(rollouts(tok, **settings), 8, plan)
    first = rollouts(tok, **settings)
    before = run(first, 2, plan)
    assert first.in_flight > 0
    torch.save({"partial": first.state_dict()}, tmp_path / "state.pt")
    second = rollouts(tok, **settings)  # a new engine and loop, as a resumed run builds them
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["partial"])
    after = {}
    for step in range(3, 9):
        samples, _ = second.at(step, 100 + step)([], [], [], "test")
        for i, s in enumerate(samples):
            after[(s.extra_info["index"], i % PARAMS.n)] = (s, step)
    assert set(before) | set(after) == set(whole) and not set(before) & set(after)
    for key, (s, step) in {**before, **after}.items():
        same(s, whole[key][0])
        assert step == whole[key][1] and s.drawn_at == whole[key][0].drawn_at


def test_a_carried_sample_keeps_its_kv_budget_through_a_save_and_a_lowered_budget(tok):
    often = PARAMS.replace(stop_token_ids=tuple(range(40, 70)))  # some groups end within the first step
    partial = rollouts(tok, RKV, params=often, finish_frac=0.25, max_tokens=3, max_staleness=3)
    rows, texts = prompts(0, 4)
    partial.at(1, 101)(rows, texts, [r.index for r in rows], "test")
    going = [m for g in partial.groups for m in g.members if not m.ended]
    assert going and all(m.kv_budget == RKV.budget for m in going)
    partial.load_state_dict(torch.load(io.BytesIO(_saved(partial.state_dict())), weights_only=True))
    partial.engine.set_kv_budget(RKV.budget - 8)  # rollout.kv.budget=auto lowered it between the steps
    carried = []
    for step in range(2, 5):
        samples, _ = partial.at(step, 100 + step)([], [], [], "test")
        carried += [s for s in samples if 1 in s.drawn_at and step in s.drawn_at]
    assert carried and all(s.kv[0].kv_budget == RKV.budget for s in carried)  # resumed under the budget it was drawn under


def _saved(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def dense_logprobs(model, sample) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = len(sample.prompt_ids)
    return logp[p - 1: -1].gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def test_the_correction_ratio_over_a_carried_sample_uses_each_tokens_sampler(tok):
    model = tiny_model("llama", vocab=len(tok))
    often = PARAMS.replace(stop_token_ids=tuple(range(40, 70)))  # some groups end within the first step
    partial = rollouts(tok, model=model, params=often, finish_frac=0.25, max_tokens=3, max_staleness=3)
    rows, texts = prompts(0, 4)
    partial.at(1, 101)(rows, texts, [r.index for r in rows], "test")
    assert partial.in_flight
    old = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    partial.engine.update_weights(new.items())  # the update between the steps
    carried = []
    for step in range(2, 6):
        samples, _ = partial.at(step, 100 + step)([], [], [], "test")
        carried += [s for s in samples if 1 in s.drawn_at and step in s.drawn_at and len(set(s.drawn_at)) == 2]
        partial.engine.update_weights(new.items())  # unchanged from here: each later step's tokens are the new weights'
    assert carried
    s = carried[0]
    first = s.drawn_at.count(1)
    batch = to_train_batch([s], "cpu")
    logp_old = dense_logprobs(model, s)[None]  # this step's dense policy: the new weights
    log_xi, _ = explain(CorrectionConfig(), logp_old, batch.logp_sparse, batch.mask)
    behaviour = torch.tensor(s.logp_sparse)
    torch.testing.assert_close(log_xi[0], (logp_old[0] - behaviour).clamp(-20, 20), atol=1e-6, rtol=0)
    model.load_state_dict(old)
    drew = dense_logprobs(model, s)
    # The step-1 tokens kept the old weights' log-probs, the later ones are the new weights' (a dense engine at
    # temperature 1: the sampler's log-prob is the dense one), so the ratio is 1 on the new tokens only.
    assert (behaviour[:first] - drew[:first]).abs().max() < 1e-4
    assert log_xi[0, :first].abs().max() > 1e-3
    assert log_xi[0, first:].abs().max() < 1e-4


MULTI_TURN_ENV = '''
max_turns = 3


async def step(state, action, extra_info):
    # a reply after every turn; the episode ends early where the action's length is a multiple of 3
    return {"next_state": state + action + "\\nnext:", "reward": float(len(action) % 2), "done": len(action) % 3 == 0,
            "extra_info": extra_info}
'''


@pytest.mark.parametrize("kv", [None, RKV], ids=["dense", "rkv"])
def test_multi_turn_episodes_carried_between_and_inside_turns_are_the_synchronous_ones(tok, kv, tmp_path):
    """A 3-turn env: episodes cut inside a turn and between turns, carried over steps with unchanged weights, end with
    the tokens, masks, rewards and turns of an uninterrupted loop on the same prompts and seeds. Dense, that is the
    synchronous env loop (rollout/worker.py), whose engine sessions keep each trajectory's KV between turns where the
    carried loop re-prefills the history: the same tokens. Compressed, a held compressed cache is not the
    re-prefilled one (the history's KV is compressed differently), so the reference is the loop that carries
    nothing (`max_staleness=0`), which re-prefills every turn as well."""
    from sparserl.rollout.worker import rollout

    path = tmp_path / "multi_turn.py"
    path.write_text(MULTI_TURN_ENV)
    env = load_env(str(path)).module
    model = tiny_model("llama", vocab=len(tok))
    params = PARAMS.replace(stop_token_ids=tuple(range(40, 70)))  # turns that end before the cap, to go on
    plan = {1: (0, 4), 2: (4, 4)}

    def partial(**settings):
        return PartialRollouts(NativeEngine(model, tok, num_slots=4096, kv=kv), tok, env, params,
                               PartialSettings(**settings), show_progress=False)

    if kv is None:
        sync = {}
        for step, (first, count) in plan.items():
            rows, texts = prompts(first, count)
            samples, _ = rollout(NativeEngine(model, tok, num_slots=4096), tok, env, rows, texts,
                                 params.replace(seed=100 + step), None, None, [r.index for r in rows])
            sync.update({(s.extra_info["index"], i % params.n): s for i, s in enumerate(samples)})
    else:
        sync = {k: s for k, (s, _) in run(partial(max_staleness=0), 2, plan).items()}
    carried = partial(finish_frac=0.5, max_tokens=3, max_staleness=5)
    got = run(carried, 8, plan)
    assert carried.in_flight == 0 and set(got) == set(sync) and len(got) == 16
    assert sum(s.num_turns > 1 for s, _ in got.values()) >= 4  # episodes with several turns
    assert sum(len(set(s.drawn_at)) > 1 and s.num_turns > 1 for s, _ in got.values()) >= 2  # carried multi-turn ones
    for key, (s, _) in got.items():
        ref = sync[key]
        assert s.response_ids == ref.response_ids and s.loss_mask == ref.loss_mask, key
        assert (s.reward, s.num_turns, s.turn_lens, s.status, s.compressed_at) == \
            (ref.reward, ref.num_turns, ref.turn_lens, ref.status, ref.compressed_at), key
        assert max(abs(x - y) for x, y in zip(s.logp_sparse, ref.logp_sparse)) < LOGP_TOL
        assert len(s.drawn_at) == len(s.response_ids)
    if kv is not None:
        assert sum(bool(s.compressed_at) for s, _ in got.values()) >= 4  # the caches were compressed
    # the episodes in flight after step 2 (env states, turn starts) through a save and load into a new loop
    first = partial(finish_frac=0.5, max_tokens=3, max_staleness=5)
    done = run(first, 2, plan)
    assert any(m.turn_start > 0 for g in first.groups for m in g.members if not m.ended)  # mid-episode
    second = partial(finish_frac=0.5, max_tokens=3, max_staleness=5)
    second.load_state_dict(torch.load(io.BytesIO(_saved(first.state_dict())), weights_only=True))
    for step in range(3, 9):
        samples, _ = second.at(step, 100 + step)([], [], [], "test")
        done.update({(s.extra_info["index"], i % params.n): (s, step) for i, s in enumerate(samples)})
    assert set(done) == set(got)
    for key, (s, step) in done.items():
        assert (s.response_ids, s.reward, s.drawn_at, step) == (got[key][0].response_ids, got[key][0].reward,
                                                                 got[key][0].drawn_at, got[key][1]), key
