"""`sync_weights` gathers in the engine's dtype and hands nothing to a rank whose engine does not receive.

One process, the actor's `FullState` walk over a plain tiny model (the walk over real shards on 2 processes
is tests/distributed/test_load_rank0.py).
"""
import torch

from sparserl.actor.actor import FullState
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.weight_sync import sync_weights
from tests.conftest import tiny_model


class CountingState(FullState):
    """A FullState that records how `sync_weights` walked it."""

    def __init__(self, model):
        super().__init__(model)
        self.calls, self.walked = [], []

    def gather(self, dtype=None, keep=True):
        self.calls.append((dtype, keep))
        for name, t in super().gather(dtype, keep):
            self.walked.append(name)
            yield name, t


def test_full_state_casts_before_handing_over_and_drops_on_request():
    model = tiny_model("llama")
    full = dict(FullState(model))
    assert list(full) == list(model.state_dict()) and all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    half = dict(FullState(model).gather(dtype=torch.bfloat16))
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    assert list(FullState(model).gather(keep=False)) == [(k, None) for k in full]


def test_bf16_native_engine_gets_bf16_tensors_and_counts_their_bytes():
    actor_model = tiny_model("llama", seed=1)  # fp32
    engine = NativeEngine(tiny_model("llama", seed=0, dtype=torch.bfloat16), num_slots=64, eos_token_ids=[])
    assert engine.receives_weights and engine.weight_dtype == torch.bfloat16
    state = CountingState(actor_model)
    metrics = sync_weights(state, engine)
    assert state.calls == [(torch.bfloat16, True)]
    want = {k: v.to(torch.bfloat16) for k, v in actor_model.state_dict().items()}
    got = engine.runner.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert metrics["perf/weight_sync_gb"] * 2**30 == sum(v.numel() * 2 for v in want.values())


def test_quantized_native_engine_is_handed_the_actor_dtype():
    """Its layers are quantized from the tensor as it arrives: the same as before sync_weights knew of dtypes."""
    actor_model = tiny_model("llama", seed=1)
    engines = [NativeEngine(tiny_model("llama", seed=0, dtype=torch.bfloat16), num_slots=64, eos_token_ids=[],
                            quantization="int8") for _ in range(2)]
    assert engines[0].weight_dtype is None
    sync_weights(FullState(actor_model), engines[0])
    engines[1].update_weights(list(actor_model.state_dict().items()))
    layers = [e.runner.quant.all_layers() for e in engines]
    assert layers[0] and len(layers[0]) == len(layers[1])
    for a, b in zip(*layers):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)


def test_a_rank_that_does_not_receive_joins_every_gather_and_hands_nothing_over():
    class Peer:
        receives_weights, weight_dtype = False, torch.bfloat16

        def update_weights(self, named):
            raise AssertionError("a non-receiving engine was handed tensors")

    model = tiny_model("qwen2")
    state = CountingState(model)
    metrics = sync_weights(state, Peer())
    assert state.calls == [(torch.bfloat16, False)] and state.walked == list(model.state_dict())
    assert metrics["perf/weight_sync_gb"] == 0.0
