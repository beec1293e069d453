"""The static decode step (`rollout.cuda_graphs=on`, run eagerly on CPU) against the eager engine: same tokens,
same log-probs, dense and compressed, across continuous batching, sessions and `dense()`; and no tensors built
from Python lists, no host reads, inside the step."""
import pytest
import torch

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native import graph_step
from sparserl.engines.native.graph_step import BUCKETS, StaticDecode, bucket_sizes, resolve_cuda_graphs
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.kv import KVPolicyConfig
from tests.conftest import tiny_model
from tests.unit.test_engine_sessions import OBS, PROMPTS as SESSION_PROMPTS, assert_same_samples, episodes

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13], [6], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def kv_config(policy):
    if policy == "none":
        return None
    return KVPolicyConfig(algorithm=policy, budget=16, window=4, divide_length=8, kernel=3, sinks=2)


def make(graphs, family="llama", kv=None, max_num_seqs=5, **kw):
    return NativeEngine(tiny_model(family), num_slots=2048, eos_token_ids=[], kv=kv, cuda_graphs=graphs,
                        max_num_seqs=max_num_seqs, **kw)


def rollout(engine, max_new=(24, 40, 31, 27, 36), n=(2, 1, 2, 1, 2), temperature=1.0, top_p=1.0):
    # Ragged prompts and lengths, n samples each, more sequences than max_num_seqs: sequences finish at different
    # steps and waiting ones are admitted (mixed eager steps between the static ones).
    reqs = [GenerationRequest(p, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new[i],
                                                n=n[i], seed=11), request_id=i) for i, p in enumerate(PROMPTS)]
    return engine.generate(reqs)


def count_static_steps(engine, monkeypatch) -> list[int]:
    sizes = []
    step = engine.runner.graphs.step

    def counted(seqs, *args, **kw):
        sizes.append(len(seqs))
        return step(seqs, *args, **kw)

    monkeypatch.setattr(engine.runner.graphs, "step", counted)
    return sizes


def assert_same(a, b, tol=1e-5):
    assert [g.request_id for g in a] == [g.request_id for g in b]
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logp_sparse, y.logp_sparse)) < tol


def test_resolve_and_buckets():
    assert resolve_cuda_graphs("auto", torch.device("cpu")) is False
    assert resolve_cuda_graphs("auto", torch.device("cuda")) is True
    assert resolve_cuda_graphs("on", torch.device("cpu")) is True
    assert resolve_cuda_graphs("off", torch.device("cuda")) is False
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        resolve_cuda_graphs("yes", torch.device("cpu"))
    assert bucket_sizes(256) == list(BUCKETS)
    assert bucket_sizes(10) == [1, 2, 4, 8, 10]
    assert bucket_sizes(400)[-3:] == [320, 384, 400]
    # The engine's option reaches the runner; the pool gets its sink slot, never handed out.
    engine = make("on")
    assert isinstance(engine.runner.graphs, StaticDecode) and engine.runner.graphs.capture is False
    assert engine.runner.k_cache[0].shape[0] == engine.pool.num_slots + 1
    assert make("off").runner.graphs is None


@pytest.mark.parametrize("family,policy", [("llama", "none"), ("qwen2", "none"), ("llama", "rkv"),
                                           ("llama", "snapkv"), ("qwen2", "streaming")])
def test_static_steps_match_eager_rollouts(family, policy, monkeypatch):
    eager = make("off", family, kv_config(policy))
    static = make("on", family, kv_config(policy))
    sizes = count_static_steps(static, monkeypatch)
    a, b = rollout(eager), rollout(static)
    assert_same(a, b)
    # Most steps were static, at several batch sizes, some of them padded (3 rows run as a bucket of 4).
    assert len(sizes) > 30 and len(set(sizes)) >= 3 and set(sizes) - set(bucket_sizes(5))
    if policy != "none":
        assert eager.stats().compressions == static.stats().compressions > 0
    assert static.stats().extra["rollout/graph_captures"] == 0.0  # nothing is captured on CPU
    assert static.runner.graphs.rows == {}  # every finished sequence gave its row back


def test_static_steps_through_the_paged_decode_entry_point():
    # CUDA takes `paged_decode_attention` (int32 table, (B,) lengths, zero rows for padding); on CPU without the
    # interpreter it runs its torch reference, the same contract.
    # (Under the Triton interpreter, CI's CPU runs, every layer of every step interprets the kernel: a short rollout
    # that still compacts, runs ragged rows and admits waiting sequences.)
    eager, static = make("off", kv=kv_config("rkv"), max_num_seqs=3), make("on", kv=kv_config("rkv"), max_num_seqs=3)
    static.runner.graphs.attention.use_kernel = True
    short = dict(max_new=(20, 12, 18, 9, 14), n=(1, 1, 2, 1, 1))
    assert_same(rollout(eager, **short), rollout(static, **short))
    assert static.stats().compressions > 0


def test_truncated_and_greedy_rows_share_a_static_batch():
    def mixed(engine):
        params = [SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=30, seed=2),
                  SamplingParams(temperature=0.0, max_new_tokens=25),
                  SamplingParams(temperature=1.0, top_k=5, max_new_tokens=28, n=2, seed=4)]
        return engine.generate([GenerationRequest(p, q, i) for i, (p, q) in enumerate(zip(PROMPTS, params))])

    assert_same(mixed(make("off", max_num_seqs=8)), mixed(make("on", max_num_seqs=8)))


def test_static_step_builds_no_tensors_from_lists_and_reads_nothing_back(monkeypatch):
    engine = make("on", kv=kv_config("rkv"))
    inside = [False]
    calls = {"tensor": 0, "as_tensor": 0, "tolist": 0, "item": 0}

    def spy(name, fn):
        def wrapped(*args, **kw):
            if inside[0] and (name != "as_tensor" or isinstance(args[0], (list, tuple))):
                calls[name] += 1
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(torch, "tensor", spy("tensor", torch.tensor))
    monkeypatch.setattr(torch, "as_tensor", spy("as_tensor", torch.as_tensor))
    monkeypatch.setattr(torch.Tensor, "tolist", spy("tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "item", spy("item", torch.Tensor.item))
    step = engine.runner.graphs.step
    steps = [0]

    def watched(*args, **kw):
        inside[0] = True
        steps[0] += 1
        try:
            return step(*args, **kw)
        finally:
            inside[0] = False

    monkeypatch.setattr(engine.runner.graphs, "step", watched)
    gens = rollout(engine)
    assert steps[0] > 30 and all(len(g.token_ids) >= 24 for g in gens)
    assert calls == {"tensor": 0, "as_tensor": 0, "tolist": 0, "item": 0}


def test_sessions_continue_over_static_steps():
    params_of = lambda i: SamplingParams(temperature=1.0, max_new_tokens=[12, 7, 16][i], seed=3)  # noqa: E731

    def engine(graphs):
        return NativeEngine(tiny_model("llama"), num_slots=1024, eos_token_ids=[], cuda_graphs=graphs)

    cont, ref = engine("on"), engine("off")
    assert_same_samples(episodes(cont, params_of, sessions=True), episodes(ref, params_of, sessions=False))
    firsts = sum(len(p) for p in SESSION_PROMPTS)
    assert cont.stats().prefill_tokens == firsts + 2 * len(SESSION_PROMPTS) * (1 + len(OBS))


def test_dense_block_and_weight_release_with_static_steps():
    kv = kv_config("rkv")
    static = make("on", kv=kv, release_weights=True)
    dense_ref = rollout(make("off"))
    sparse_ref = rollout(make("off", kv=kv))
    with static.dense():
        assert_same(rollout(static), dense_ref)
    assert_same(rollout(static), sparse_ref)
    # Sleep drops the pool and the weights: the static buffers go too, and come back on the next decode.
    state = {k: v.clone() for k, v in static.runner.model.state_dict().items()}
    static.sleep()
    assert static.runner.graphs.table is None
    static.update_weights(state.items())
    static.wake()
    assert_same(rollout(static), sparse_ref)


def test_the_table_grows_under_running_rows(monkeypatch):
    # A narrow width step: the sequences admitted later reserve more than the table is wide, while earlier ones
    # keep decoding in their rows.
    monkeypatch.setattr(graph_step, "WIDTH_STEP", 16)
    eager, static = make("off"), make("on")
    widths = []
    grow = static.runner.graphs._ensure_width

    def watched(need):
        grow(need)
        widths.append(static.runner.graphs.width)

    monkeypatch.setattr(static.runner.graphs, "_ensure_width", watched)
    max_new = (8, 9, 10, 40, 36)
    assert_same(rollout(eager, max_new=max_new), rollout(static, max_new=max_new))
    assert widths[0] == 32 and widths[-1] == 48
