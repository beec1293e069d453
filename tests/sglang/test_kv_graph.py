"""The `sparserl_kv` backend's CUDA-graph hooks, on CPU and without an engine: they exist with SGLang's signatures,
a replay's state update (`init_forward_metadata_out_graph`) gives the same per-step metadata as an eager
`init_forward_metadata` of the same batch, padding rows go to the ring's spare row, and the static buffers keep
their addresses from step to step (what a captured graph reads). Replaying a real graph needs a GPU (docs/sglang.md).
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from tests.sglang.host import HAVE_SGLANG, SKIP_REASON

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)
LAYERS, H_KV, H_Q, D, ROWS = 2, 2, 4, 8, 6
HOOKS = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_cuda_graph_state", "forward")


@pytest.fixture(scope="module")
def kvb():
    import os

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sparserl.engines.sglang import kv_backend

    return kv_backend


def _runtime(kvb):
    from sparserl.kv import KVPolicyConfig

    keys = [torch.zeros(64, H_KV, D) for _ in range(LAYERS)]
    pool = SimpleNamespace(start_layer=0, layer_num=LAYERS, get_key_buffer=lambda i: keys[i],
                           get_value_buffer=lambda i: keys[i])
    runner = SimpleNamespace(token_to_kv_pool=pool, device="cpu",
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(ROWS, 64, dtype=torch.int32)),
                             token_to_kv_pool_allocator=SimpleNamespace(size=64, available_size=lambda: 64))
    rt = kvb.KVRuntime(KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=4), runner, trace=False)
    rt.compactor.offset[:] = [0, 7, 3, 0, 11, 2]  # rows compacted earlier: logical minus physical lengths
    for row, seen in [(1, 9), (2, 2), (4, 5)]:
        rt.compactor.state[row] = _state(seen)
    return rt


def _state(seen):
    from sparserl.engines.sglang.kv_compactor import RequestKV

    return RequestKV(queries_seen=seen)


class _Base:
    """A base backend that records what reaches it."""

    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, forward_batch):
        self.calls.append("init")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.calls.append(("out_graph", in_capture))

    def init_forward_metadata_in_graph(self, forward_batch):
        self.calls.append("in_graph")

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.calls.append(("state", max_bs, max_num_tokens))

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append("forward")
        return q


def _decode():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode.DECODE


def _step(rows, physical, seed):
    q = torch.randn(len(rows), H_Q * D, generator=torch.Generator().manual_seed(seed))
    return torch.tensor(physical), q


def test_hooks_have_sglang_signatures(kvb, monkeypatch):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    backend = _Base()
    monkeypatch.setattr(kvb, "_RUNTIME", _runtime(kvb))
    kvb._wrap(backend)
    for name in HOOKS:
        ours = list(inspect.signature(getattr(backend, name)).parameters.values())
        base = [p for p in inspect.signature(getattr(AttentionBackend, name)).parameters.values() if p.name != "self"]
        assert [(p.name, p.kind, p.default) for p in ours[:len(base)]] == \
               [(p.name, p.kind, p.default) for p in base], name
    assert backend.init_forward_metadata_in_graph.__func__ is _Base.init_forward_metadata_in_graph  # the base's own


def test_replay_update_matches_eager_and_keeps_buffer_addresses(kvb, monkeypatch):
    eager, graph, planned = _runtime(kvb), _runtime(kvb), _runtime(kvb)
    base = _Base()
    monkeypatch.setattr(kvb, "_RUNTIME", graph)
    kvb._wrap(base)
    base.init_cuda_graph_state(8, 8)
    assert graph.graphs and graph.decode.capacity == 8 and base.calls == [("state", 8, 8)]
    static_positions = torch.zeros(8, dtype=torch.long)  # the graph runner's input buffer
    pointers = None
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=H_Q, qk_head_dim=D)
    for step, (rows, physical) in enumerate([([1, 2, 4], [30, 12, 20]), ([1, 2, 4], [31, 13, 21]),
                                             ([4, 1], [22, 32])]):
        positions, q = _step(rows, physical, step)
        # eager: the scheduler's rows, then init_forward_metadata on the runner's copy of the batch
        eager.batch_rows = list(rows)
        fb = SimpleNamespace(forward_mode=_decode(), batch_size=len(rows), positions=positions.clone(),
                             sampling_info=SimpleNamespace(), req_pool_indices=torch.tensor(rows))
        eager.before_forward(fb)
        eager.capture(layer, q, decode=True)
        # replay: padded to 4 rows, positions already copied into the static buffer
        padded = 4
        static_positions[:len(rows)] = positions
        view = SimpleNamespace(forward_mode=_decode(), actual_forward_mode=_decode(), batch_size=padded,
                               num_padding=padded - len(rows), positions=static_positions[:padded],
                               req_pool_indices=torch.tensor(rows + [0] * (padded - len(rows))))
        graph.batch_rows = list(rows)
        base.init_forward_metadata_out_graph(view)
        graph.capture(layer, torch.cat([q, torch.randn(padded - len(rows), H_Q * D)]), decode=True)
        # the reference: the compactor's own planner, one token per row
        planned.compactor.plan_capture(rows, [1] * len(rows), [False] * len(rows))
        _, ref_rows, ref_places = planned.compactor._capture_index
        n = len(rows)
        assert torch.equal(fb.positions, view.positions[:n])
        assert torch.equal(fb.positions, positions + torch.tensor([eager.compactor.offset[r] for r in rows]))
        assert torch.equal(fb.sampling_info.sparserl_logical_positions, fb.positions)
        assert torch.equal(eager.decode.index[:, :n], graph.decode.index[:, :n])
        assert torch.equal(graph.decode.rows[:n], ref_rows) and torch.equal(graph.decode.places[:n], ref_places)
        assert graph.decode.rows[n:padded].tolist() == [graph.compactor.ring.spare_row] * (padded - n)
        assert graph.decode.offsets[n:padded].tolist() == [0] * (padded - n)
        assert {r: s.queries_seen for r, s in eager.compactor.state.items()} == \
               {r: s.queries_seen for r, s in graph.compactor.state.items()}
        ring_e, ring_g = eager.compactor.ring.buffers[1], graph.compactor.ring.buffers[1]
        assert torch.equal(ring_e[:ROWS], ring_g[:ROWS])  # the spare row holds only padding
        now = (graph.decode.index.data_ptr(), graph.decode.logical.data_ptr(), ring_g.data_ptr(),
               eager.decode.index.data_ptr(), eager.decode.logical.data_ptr(), fb.positions.data_ptr())
        assert now[4] == now[5]  # the eager positions are a view of the static buffer
        assert pointers is None or now == pointers
        pointers = now
    assert [c for c in base.calls if c != "forward"][1:] == [("out_graph", False)] * 3


def test_capture_pass_is_all_padding_and_touches_no_request(kvb):
    rt = _runtime(kvb)
    before = {r: s.queries_seen for r, s in rt.compactor.state.items()}
    fb = SimpleNamespace(forward_mode=_decode(), batch_size=5, positions=torch.zeros(5, dtype=torch.long),
                         req_pool_indices=torch.zeros(5, dtype=torch.long))
    rt.before_graph(fb, in_capture=True)
    assert rt.decode.rows[:5].tolist() == [rt.compactor.ring.spare_row] * 5
    assert rt.decode.offsets[:5].tolist() == [0] * 5 and rt.decode_forwards == 0
    assert {r: s.queries_seen for r, s in rt.compactor.state.items()} == before
