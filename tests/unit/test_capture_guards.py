"""What keeps the static decode step capturable, checked without a GPU: models whose RoPE reads the largest
position on the host in every forward (transformers' dynamic and longrope scaling) get graphs off with one log line
(models built on the meta device: no weights), and the engine reports the capture time and counts the step's
event waits (zero on CPU, where nothing is captured and nothing waits)."""
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.graph_step import StaticDecode, capture_blocker, resolve_cuda_graphs
from sparserl.engines.types import GenerationRequest, SamplingParams

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 4.0,
                 "original_max_position_embeddings": 1024, "rope_theta": 10000.0},
}
CUDA = torch.device("cuda")  # only its type is read: nothing runs on it


def model(rope: str, device="meta") -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=dict(ROPES[rope]))).eval()


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()]


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_host_branching_rope_turns_graphs_off_in_one_line(rope, caplog):
    m = model(rope)
    assert capture_blocker(m) is not None
    with caplog.at_level(logging.WARNING, logger="sparserl.engines.native.graph_step"):
        assert resolve_cuda_graphs("auto", CUDA, m) is False
        assert resolve_cuda_graphs("on", CUDA, m) is False
        assert resolve_cuda_graphs("off", CUDA, m) is False  # off stays off, silently
    said = lines(caplog)
    assert len(said) == 2 and all(repr(rope) in line for line in said), said


@pytest.mark.parametrize("rope", ["default", "linear"])
def test_other_ropes_keep_graphs(rope, caplog):
    m = model(rope)
    assert capture_blocker(m) is None
    with caplog.at_level(logging.WARNING):
        assert resolve_cuda_graphs("auto", CUDA, m) is True
        assert resolve_cuda_graphs("auto", torch.device("cpu"), m) is False
    assert lines(caplog) == []


def test_the_engine_asks_about_its_model(caplog):
    with caplog.at_level(logging.WARNING):
        dynamic = NativeEngine(model("dynamic", "cpu"), num_slots=256, eos_token_ids=[], cuda_graphs="on")
        plain = NativeEngine(model("default", "cpu"), num_slots=256, eos_token_ids=[], cuda_graphs="on")
    assert dynamic.runner.graphs is None and isinstance(plain.runner.graphs, StaticDecode)
    assert len(lines(caplog)) == 1
    gens = dynamic.generate([GenerationRequest([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=5, seed=0), 0)])
    assert len(gens[0].token_ids) == 5


def test_capture_time_and_waits_are_reported():
    engine = NativeEngine(model("default", "cpu"), num_slots=256, eos_token_ids=[], cuda_graphs="on", max_num_seqs=4)
    engine.generate([GenerationRequest([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=0), 0)])
    extra = engine.stats().extra
    assert extra["rollout/graph_captures"] == 0.0 and extra["rollout/graph_capture_s"] == 0.0  # CPU: eager
    assert engine.runner.graphs.waits == 0 and engine.runner.graphs.event is None
    assert "rollout/graph_capture_s" not in NativeEngine(model("default", "cpu"), num_slots=64, eos_token_ids=[],
                                                         cuda_graphs="off").stats().extra
