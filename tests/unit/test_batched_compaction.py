"""Batched compaction (`sparserl/kv/compaction.py::compact_batch`) against one request at a time, and the query
ring's decode-only capture (`Compressor.decode_places` + `QueryRing.capture_rows`) against `plan` + `capture`.

Every check runs on small random fp32 tensors with fixed seeds and must match exactly: keep-sets, kept positions
and the pool's contents bitwise.
"""
import copy
from types import SimpleNamespace

import pytest
import torch

from sparserl.engines.native.compressor import Compressor
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.sequence import Sequence
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.kv import KVPolicyConfig
from sparserl.kv.base import score_tokens
from sparserl.kv import compaction
from sparserl.kv.compaction import CompactionState, DueRequest, QueryRing, compact_batch, select_entries


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


# ---------------------------------------------------------------- batched against one request at a time
@torch.inference_mode()
def per_request(cfg, state, ring, row, slots, k_buffers, v_buffers, keep, cached):
    """One request alone, layer by layer: `select_entries` and a gather/scatter per layer and buffer."""
    indices, kept = select_entries(cfg, state, ring, row, slots, k_buffers, keep)
    heads = torch.arange(k_buffers[0].shape[1])[:, None]
    for layer, idx in enumerate(indices):
        for buf in (k_buffers[layer], v_buffers[layer]):
            buf[slots[:keep]] = buf[slots[idx], heads].transpose(0, 1)
    state.kept_positions, state.appended_from = kept, cached
    return kept


class World:
    """A random pool, query ring and requests; `clone` gives an independent copy to compact another way."""

    def __init__(self, lengths, layers=3, kv_heads=2, q_heads=4, dim=8, window=4, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.num_slots = 4 * sum(lengths) + 64
        self.k = [torch.randn(self.num_slots, kv_heads, dim, generator=gen) for _ in range(layers)]
        self.v = [torch.randn(self.num_slots, kv_heads, dim, generator=gen) for _ in range(layers)]
        self.ring = QueryRing(layers, len(lengths), window)
        self.ring.allocate(q_heads, dim, torch.float32, "cpu")
        for buf in self.ring.buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        free = torch.randperm(self.num_slots, generator=gen)
        self.slots, at = [], 0
        for n in lengths:
            self.slots.append(free[at:at + n].clone())
            at += n
        self.spare = free[at:]  # slots for entries appended later
        self.states = [CompactionState(queries_seen=n + 3 * i) for i, n in enumerate(lengths)]
        self.cached = list(lengths)

    def clone(self):
        other = copy.copy(self)
        other.k, other.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        other.states = [copy.deepcopy(s) for s in self.states]
        other.slots, other.cached = list(self.slots), list(self.cached)
        return other

    def due(self, keeps):
        return [DueRequest(st, i, s, keep, c) for i, (st, s, keep, c) in
                enumerate(zip(self.states, self.slots, keeps, self.cached))]

    def after(self, keeps, grow):
        """Shrink every request to its kept entries, then append `grow[i]` new entries (and queries)."""
        at = 0
        for i, (keep, g) in enumerate(zip(keeps, grow)):
            self.slots[i] = torch.cat([self.slots[i][:keep], self.spare[at:at + g]])
            self.cached[i] += g
            self.states[i].queries_seen += g
            at += g


def compare(cfg, lengths, keeps, seed=0, rounds=2, **shape):
    batched = World(lengths, seed=seed, **shape)
    alone = batched.clone()
    for _ in range(rounds):  # the second round scores kept entries (kept_positions set) plus appended ones
        got = compact_batch(cfg, batched.ring, batched.due(keeps), batched.k, batched.v)
        want = [per_request(cfg, d.state, alone.ring, d.row, d.slots, alone.k, alone.v, d.keep, d.cached)
                for d in alone.due(keeps)]
        for g, w, st in zip(got, want, batched.states):
            assert torch.equal(g, w) and torch.equal(st.kept_positions, w)
        for a, b in zip(batched.k + batched.v, alone.k + alone.v):
            assert torch.equal(a, b)  # the whole pool, bitwise
        grow = [3 + i % 4 for i in range(len(lengths))]
        batched.after(keeps, grow)
        alone.after(keeps, grow)
    return batched


RAGGED = [20, 20, 27, 20, 13, 27, 20]  # with KEEPS, four (length, keep) shapes: four chunks
KEEPS = [12, 12, 12, 12, 9, 14, 12]


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv", "streaming"])
@pytest.mark.parametrize("share", ["head", "layer", "all"])
@pytest.mark.parametrize("variant", ["paper", "reference"])
def test_same_keep_sets_and_pool_as_one_at_a_time(algorithm, share, variant):
    cfg = KVPolicyConfig(algorithm=algorithm, budget=12, window=4, divide_length=8, kernel=3, share=share,
                         variant=variant, sinks=2)
    compare(cfg, RAGGED, KEEPS, seed=1)


def test_gqa_groups_and_ties():
    # 6 query heads on 2 KV heads; equal keys and importance alone (lambda 1) make exact score ties at the top-k
    # boundary, which must break as they do alone.
    cfg = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=8, kernel=5, share="head", mix_lambda=1.0)
    world = World(RAGGED, q_heads=6, seed=2)
    for buf in world.k:
        buf[world.slots[0][:12]] = buf[world.slots[0][0]].clone()
    alone = world.clone()
    keys = world.k[0][world.slots[0]].transpose(0, 1)
    order = world.ring.window_order(world.states[0].queries_seen, RAGGED[0], "cpu")
    scores = score_tokens(cfg, keys, world.ring.read(0, 0, order), torch.arange(RAGGED[0]).expand(2, -1))
    cand = scores[0, :RAGGED[0] - 4]
    kth = cand.topk(KEEPS[0] - 4).values.min()
    assert (cand >= kth).sum() > KEEPS[0] - 4, "the test needs tied scores at the top-k boundary"
    got = compact_batch(cfg, world.ring, world.due(KEEPS), world.k, world.v)
    want = [per_request(cfg, d.state, alone.ring, d.row, d.slots, alone.k, alone.v, d.keep, d.cached)
            for d in alone.due(KEEPS)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_long_rows_across_chunks(monkeypatch):
    # Longer rows than the window, and a chunk bound small enough to split one shape over several chunks.
    monkeypatch.setattr(compaction, "CPU_CHUNK_SCORE_ELEMENTS", 2 * 2 * 64 * 64)
    cfg = KVPolicyConfig(algorithm="rkv", budget=40, window=8, divide_length=16, kernel=7, share="head")
    compare(cfg, [64] * 5 + [50], [40] * 6, seed=3, rounds=1, window=8)


def test_padding_free_chunks():
    assert compaction.batch_chunks([], 4, 2) == []
    world = World(RAGGED)
    chunks = compaction.batch_chunks(world.due(KEEPS), 4, 2)
    assert sorted(sum(chunks, [])) == list(range(len(RAGGED))) and len(chunks) == 4
    for chunk in chunks:
        assert len({(RAGGED[i], KEEPS[i]) for i in chunk}) == 1


# ---------------------------------------------------------------- a whole native-engine rollout
def test_native_rollout_same_tokens_and_logprobs_as_one_at_a_time():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    kv = KVPolicyConfig(algorithm="rkv", budget=10, window=3, divide_length=4, kernel=3, share="head")
    prompts = [[1, 5, 7, 9, 3], [2, 8, 4], [4, 4, 4, 4, 6, 10, 11], [9, 8, 7, 6, 5, 4, 3]]
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=28, seed=i, n=3), i)
            for i, p in enumerate(prompts)]
    batches, outs = [], []
    for mode in ("batched", "alone"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        engine = NativeEngine(model, num_slots=1024, eos_token_ids=[], kv=kv)
        comp = engine.compression
        if mode == "alone":  # the path before batching: every due sequence scored and moved by itself
            def alone(due, scheduler, comp=comp):
                for seq, st in due:
                    slots = torch.tensor(seq.slots, dtype=torch.long)
                    keep = st.schedule.target_len()
                    per_request(kv, st, comp.ring, st.row, slots, engine.runner.k_cache, engine.runner.v_cache,
                                keep, seq.num_cached)
                    scheduler.release_slots(seq, seq.slots[keep:])
                    seq.slots, seq.slots_version = seq.slots[:keep], seq.slots_version + 1
                    seq.compressions += 1
                    seq.compressed_at.append(len(seq.output))
            comp.compress_all = alone
        else:
            compress_all = comp.compress_all
            comp.compress_all = lambda due, scheduler: (batches.append(len(due)), compress_all(due, scheduler))
        outs.append(engine.generate(reqs))
    assert max(batches) > 1, "several sequences should come due at the same step"
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids and a.logp_sparse == b.logp_sparse  # bitwise
        assert a.kv.compressed_at == b.kv.compressed_at and a.kv.compressions >= 3
