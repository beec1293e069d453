"""Batched compaction (`sparserl/kv/compaction.py::compact_batch`) against one request at a time, and the query
ring's decode-only capture (`Compressor.decode_places` + `QueryRing.capture_rows`) against `plan` + `capture`.

Every check runs on small random fp32 tensors with fixed seeds and must match exactly: keep-sets, kept positions
and the pool's contents bitwise.
"""
from types import SimpleNamespace

import torch

from sparserl.engines.native.compressor import Compressor
from sparserl.engines.native.sequence import Sequence
from sparserl.engines.types import SamplingParams
from sparserl.kv import KVPolicyConfig
from sparserl.kv.compaction import QueryRing


def _seqs(lengths):
    return [Sequence(seq_id=i, request_index=i, sample_index=0, prompt=[1] * n, params=SamplingParams(), reserve=64)
            for i, n in enumerate(lengths)]


def test_decode_places_and_capture_rows_match_plan_and_capture():
    cfg = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=8)
    runner = SimpleNamespace(num_layers=2, device=torch.device("cpu"))
    planned, direct = Compressor(cfg, runner, 5), Compressor(cfg, runner, 5)
    seqs_a, seqs_b = _seqs([3, 6, 2]), _seqs([3, 6, 2])
    gen = torch.Generator().manual_seed(0)
    for step in range(7):  # a few decode steps: the places wrap around the window
        q = [torch.randn(3, 4, 8, generator=gen) for _ in range(2)]
        computed = [(st.row, st, 1) for st in (planned._get(s) for s in seqs_a)]
        index = planned.ring.plan(computed, "cpu")
        rows, places = direct.decode_places(seqs_b)
        for layer in range(2):
            planned.ring.capture(layer, q[layer], index)
            direct.ring.capture_rows(layer, q[layer], torch.tensor(rows), torch.tensor(places))
    for a, b in zip(seqs_a, seqs_b):
        assert planned._state[a.seq_id].queries_seen == direct._state[b.seq_id].queries_seen == 7
    for x, y in zip(planned.ring.buffers, direct.ring.buffers):
        assert torch.equal(x, y)


def test_query_ring_spare_row():
    ring = QueryRing(num_layers=2, rows=3, window=4)
    assert ring.spare_row == 3
    q = torch.randn(2, 2, 8)
    ring.capture_rows(0, q, torch.tensor([0, ring.spare_row]), torch.tensor([1, 2]))
    assert ring.buffers[0].shape == (4, 4, 2, 8)
    assert torch.equal(ring.buffers[0][3, 2], q[1]) and torch.equal(ring.buffers[0][0, 1], q[0])
