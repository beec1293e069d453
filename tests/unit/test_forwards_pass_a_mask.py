"""transformers' mask builders look for packed sequences in the position ids whenever a forward gets no attention
mask and no cache (`masking_utils.find_packed_sequence_indices`: an `if (...).all():` on a device tensor, a host
sync per forward on CUDA). The actor's forwards (actor/logprobs.py) and the native engine's eager forwards
(engines/native/runner.py) pass a 4-D dummy mask, which the builders hand through untouched and the packed
attention ignores: the function is never called in an update or in an eager rollout, and the log-probs and tokens
are bitwise those of the same forwards without the mask."""
import pytest
import torch
from transformers import masking_utils

from sparserl.actor.actor import Actor, TrainBatch
from sparserl.actor.logprobs import PackedSeqs, packed_logprobs
from sparserl.algo.loss import LossConfig
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.loss import make_loss_fn
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 10, 11, 12, 13]]


@pytest.fixture
def lookups(monkeypatch):
    """Calls of the real `find_packed_sequence_indices` (wrapped, still computing)."""
    calls = []
    real = masking_utils.find_packed_sequence_indices

    def counted(position_ids):
        calls.append(tuple(position_ids.shape))
        return real(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    return calls


def without_mask(model: torch.nn.Module) -> None:
    """The forward as it was before the dummy mask: the same call with `attention_mask` dropped."""
    forward = model.forward
    model.forward = lambda *args, attention_mask=None, **kwargs: forward(*args, **kwargs)


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = [p + torch.randint(5, 120, (r,), generator=g).tolist() for p, r in zip(PROMPTS, (6, 4, 7))]
    T = 7
    mask = torch.zeros(len(ids), T)
    for i, r in enumerate((6, 4, 7)):
        mask[i, :r] = 1.0
    return TrainBatch(ids=ids, prompt_lens=[len(p) for p in PROMPTS], mask=mask,
                      advantages=torch.tensor([1.0, -0.5, 0.25]), logp_old=-torch.rand(len(ids), T, generator=g))


def test_the_spy_sees_a_forward_without_a_mask(lookups):
    model = tiny_model()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 1, 2]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]]), use_cache=False)
    assert lookups == [(1, 5)]


def test_an_update_makes_no_packed_sequence_lookup(tmp_path, monkeypatch, lookups):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so that what init_distributed sets for its world of one is undone
        monkeypatch.delenv(key)
    tiny_model().save_pretrained(tmp_path / "ckpt")
    info = init_distributed("cpu")
    try:
        mesh = ParallelDims.from_world(1, 1).build_mesh("cpu")
        actor = Actor(str(tmp_path / "ckpt"), mesh, info.device, dtype="float32", compute_dtype="float32", lr=1e-3,
                      max_tokens_per_device=24)  # several micro-batches
        b = batch()
        b.logp_old = actor.logprobs(b)
        metrics = actor.update(b, make_loss_fn(LossConfig()), num_minibatches=2)
        assert metrics["actor/grad_norm"] > 0
        assert lookups == []
    finally:
        teardown()


def test_actor_logprobs_are_bitwise_those_without_the_mask(lookups):
    model = tiny_model()
    seqs = PackedSeqs([p + [20, 21, 22, 23] for p in PROMPTS], [len(p) for p in PROMPTS])
    logp, ent = packed_logprobs(model, seqs, torch.device("cpu"), with_entropy=True)
    assert lookups == []
    without_mask(model)
    logp0, ent0 = packed_logprobs(model, seqs, torch.device("cpu"), with_entropy=True)
    assert lookups  # the old call looked the packing up
    assert torch.equal(logp, logp0) and torch.equal(ent, ent0)


def test_an_eager_rollout_makes_no_packed_sequence_lookup(lookups):
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3), i)
            for i, p in enumerate(PROMPTS)]
    engine = NativeEngine(tiny_model(), num_slots=512, eos_token_ids=[], cuda_graphs="off", max_num_seqs=4)
    gens = engine.generate(reqs)  # prefill, mixed and decode-only steps, all eager
    assert lookups == []
    old = NativeEngine(tiny_model(), num_slots=512, eos_token_ids=[], cuda_graphs="off", max_num_seqs=4)
    without_mask(old.runner.model)
    gens0 = old.generate(reqs)
    assert lookups
    for a, b in zip(gens, gens0):
        assert a.token_ids == b.token_ids and a.logp_sparse == b.logp_sparse
