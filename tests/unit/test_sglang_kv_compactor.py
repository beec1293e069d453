"""The SGLang backend's compaction on a stand-alone pool (no sglang needed): selection by sparserl.kv, per-head
moves into the row's first slots, freed slots, logical positions across two compactions, and the records."""
import pytest
import torch

from sparserl.kv import CompressionSchedule, KVPolicyConfig, score_tokens, select_keep
from sparserl.engines.sglang.kv_compactor import KVCompactor
from sparserl.engines.sglang.kv_records import kv_stats, pool_counters

LAYERS, H_KV, H_Q, D = 2, 2, 4, 8


def pool(size=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(size, H_KV, D, generator=g) for _ in range(LAYERS)]
    v = [torch.randn(size, H_KV, D, generator=g) for _ in range(LAYERS)]
    return k, v


def feed_queries(comp, row, n, fresh, seed):
    """One forward of n tokens for `row`: capture random queries in every layer; returns them (layers, n, H_q, D)."""
    comp.plan_capture([row], [n], [fresh])
    q = torch.randn(LAYERS, n, H_Q, D, generator=torch.Generator().manual_seed(seed))
    for layer in range(LAYERS):
        comp.capture(layer, q[layer])
    return q


@pytest.mark.parametrize("share", ["head", "layer", "all"])
def test_compaction_moves_the_selected_entries_and_frees_the_rest(share):
    cfg = KVPolicyConfig(algorithm="rkv", budget=12, window=4, divide_length=4, share=share)
    comp = KVCompactor(cfg, LAYERS, H_KV, rows=3, device="cpu")
    k, v = pool()
    row, n = 1, 20
    slots = torch.randperm(150)[:n] + 1  # the row's pool slots, in entry order
    q = feed_queries(comp, row, n, True, 1)
    k0, v0 = [x.clone() for x in k], [x.clone() for x in v]
    assert comp.on_token(row, "r", prompt_len=8, outputs=1, held=n, newline=False)  # 20 >= floor 12 + 4: due at once
    done = comp.compact(row, slots, k, v, outputs=1, trace=True)
    keep = 12
    assert done.keep == keep and done.freed.tolist() == slots[keep:].tolist()
    positions = torch.arange(n).expand(H_KV, n)
    for layer in range(LAYERS):
        scores = score_tokens(cfg, k0[layer][slots].transpose(0, 1), q[layer, -4:].transpose(0, 1), positions)
        if share == "all":
            continue  # the shared set sums every layer (reduce_scores); checked through kept positions below
        idx = select_keep(scores, keep, 4, share != "head")
        for h in range(H_KV):
            assert torch.equal(k[layer][slots[:keep], h], k0[layer][slots[idx[h]], h])
            assert torch.equal(v[layer][slots[:keep], h], v0[layer][slots[idx[h]], h])
            assert done.kept_positions[layer, h].tolist() == idx[h].tolist()
    kept = done.kept_positions
    assert kept.shape == (LAYERS, H_KV, keep)
    assert (kept[..., -4:] == torch.arange(n - 4, n)).all()  # the window stays
    if share != "head":
        assert (kept == kept[:, :1]).all()  # one set for the heads of a layer
    if share == "all":
        assert (kept == kept[:1]).all()
    assert comp.offset[row] == n - keep  # decode positions = physical length - 1 + offset: the logical ones
    assert comp.take_events(row) == [(1, pytest.approx(comp.state[row].compress_s), kept.tolist())]
    assert comp.take_events(row) == []


def test_second_compaction_scores_kept_and_appended_entries_at_their_logical_positions():
    cfg = KVPolicyConfig(algorithm="streaming", budget=10, window=2, divide_length=3, sinks=2)
    comp = KVCompactor(cfg, LAYERS, H_KV, rows=2, device="cpu")
    k, v = pool()
    row = 0
    slots = torch.arange(1, 15)  # 14 entries after prefill and the first decode steps
    feed_queries(comp, row, 14, True, 2)
    assert comp.on_token(row, "r", prompt_len=4, outputs=1, held=14, newline=False)
    first = comp.compact(row, slots, k, v, outputs=1)
    assert first.kept_positions[0, 0].tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 12, 13]  # sinks + most recent
    # Three decode steps append entries at logical positions 14, 15, 16 in new slots.
    row_slots = torch.cat([slots[:10], torch.tensor([50, 51, 52])])
    for step in range(3):
        feed_queries(comp, row, 1, False, 10 + step)
        due = comp.on_token(row, "r", prompt_len=4, outputs=2 + step, held=11 + step, newline=False)
    assert due  # 3 steps after the first compaction
    second = comp.compact(row, row_slots, k, v, outputs=4)
    assert second.kept_positions[1, 1].tolist() == [0, 1, 9, 10, 11, 12, 13, 14, 15, 16]
    assert second.freed.tolist() == [50, 51, 52]
    assert comp.offset[row] == 17 - 10


def test_schedule_matches_the_native_one_and_a_new_request_resets_the_row():
    cfg = KVPolicyConfig(algorithm="rkv", budget=32, window=8, divide_length=16)
    comp = KVCompactor(cfg, LAYERS, H_KV, rows=2, device="cpu")
    native = CompressionSchedule(cfg, 20)
    held = 20
    for out in range(1, 60):
        due = comp.on_token(0, "a", 20, out, held, False)
        assert due == native.on_token(held, False)
        held = 32 if due else held + 1
    comp.offset[0] = 5
    comp.plan_capture([0], [7], [True])
    assert comp.offset[0] == 0 and comp.state[0].schedule is None and comp.state[0].queries_seen == 7


def test_records_give_the_generation_kv_stats():
    events = [[3, 0.5, None]]
    records = [[9, 2, []], [10, 2, []], [11, 2, []], [6, 3, events], [7, 3, []]]
    stats, kept = kv_stats(records, prompt_len=9, n_tokens=5)
    assert (stats.peak_slots, stats.retained_tokens, stats.total_tokens) == (11, 7, 13)
    assert stats.compressions == 1 and stats.compressed_at == [3] and stats.compress_s == 0.5 and kept == []
    with pytest.raises(RuntimeError, match="6 tokens"):
        kv_stats(records, 9, 6)
    info = {"internal_states": [{"sparserl_kv": dict(pool_size=100, pool_free=100, high_water=40, peak_running=6,
                                                     compressions=3, compress_s=0.1)}]}
    assert pool_counters(info).peak_running == 6
    with pytest.raises(RuntimeError, match="plugin"):
        pool_counters({"internal_states": [{}]})


def test_compressing_engine_runs_the_backend_without_radix_cache_or_overlap():
    from sparserl.engines.sglang.options import SGLangOptions

    dense = SGLangOptions().server_args("m", 0)
    assert dense["attention_backend"] == "torch_native" and "disable_radix_cache" not in dense
    kv = SGLangOptions(kv={"algorithm": "rkv"}).server_args("m", 0)
    assert kv["attention_backend"] == "sparserl_kv" and SGLangOptions().base_attention_backend == "torch_native"
    assert kv["disable_radix_cache"] and kv["disable_overlap_schedule"] and kv["page_size"] == 1
    assert kv["disable_cuda_graph"] and not kv["enable_mixed_chunk"] and kv["disable_prefill_cuda_graph"]
    assert "custom_logit_processor" not in str(dense)  # the sampler reads custom_params when SGLang builds a batch
    gpu = dict(device="cuda", attention_backend=None, cuda_graph=True)
    dense_gpu, kv_gpu = SGLangOptions(**gpu).server_args("m", 0), SGLangOptions(**gpu, kv={"algorithm": "rkv"}).server_args("m", 0)
    assert not dense_gpu["disable_cuda_graph"] and "disable_overlap_schedule" not in dense_gpu  # dense: graphs, overlap
    assert not kv_gpu["disable_cuda_graph"] and kv_gpu["disable_overlap_schedule"]  # compressed: decode graphs on CUDA
    assert SGLangOptions(device="cuda", attention_backend=None).base_attention_backend == "triton"
