"""Quantized rollouts (rollout.quantization): the quantized linear against its float reference within the
derived error bound, re-quantization on every weight update, generation with int8 alone and with R-KV,
the weight bytes, the dense re-score split, and the one-line errors."""
import pytest
import torch

from sparserl.config.load import load_config
from sparserl.kv import KVPolicyConfig
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.quantize import QuantLinear, check_scheme, quantize_int8
from sparserl.model.sampling import processed_logprobs
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.utils.errors import UserError
from tests.conftest import tiny_config, tiny_model

PROMPTS = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 10, 11, 12, 13], [6]]
BF16_EPS = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)


def requests(params, prompts=PROMPTS):
    return [GenerationRequest(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]


def greedy(engine, n=12):
    return [g.token_ids for g in engine.generate(requests(SamplingParams(temperature=0, max_new_tokens=n)))]


def layer(w: torch.Tensor, kernel: str, bias=None) -> QuantLinear:
    ql = QuantLinear(w.shape[1], w.shape[0], bias, kernel, torch.float32, w.device)
    ql.set_weight(w)
    return ql


def test_int8_weights_are_within_half_a_step_of_the_float_weights():
    torch.manual_seed(0)
    w = torch.randn(96, 80) * torch.rand(96, 1) * 3  # rows of different magnitude: per-row scales matter
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127  # every row uses the full range
    assert torch.allclose(s, w.abs().amax(1) / 127)
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert err.max() > s.min() / 10  # it really was rounded


@pytest.mark.parametrize("kernel", ["dequant", "fused"])
def test_quantized_linear_matches_float_within_the_error_bound(kernel):
    """|x.w - x.w_hat| <= sum_k |x_k| * s_n / 2 for weight rounding alone (dequant, fp32 activations); the
    fused CPU kernel also rounds the activations and the output to bf16: + eps * sum_k |x_k| |w_hat_nk| + eps * |y_hat|."""
    torch.manual_seed(1)
    w, b = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(5, 7, 64)
    ql = layer(w, kernel, torch.nn.Parameter(b))
    y, ref = ql(x), torch.nn.functional.linear(x, w, b)
    assert y.shape == ref.shape == (5, 7, 48) and y.dtype == torch.float32
    w_hat = ql.dequantized()
    ax = x.abs().reshape(-1, 64)
    bound = ax.sum(1, keepdim=True) * ql.scale[None, :] / 2  # (M, N)
    if kernel == "fused":
        bound = bound + BF16_EPS * ax @ w_hat.abs().t() + BF16_EPS * (y.reshape(-1, 48) - b).abs()
    err = (y - ref).reshape(-1, 48).abs()
    assert (err <= bound * 1.01 + 1e-5).all(), (err / bound).max()
    assert err.max() > 1e-4  # quantized, not the float weight
    # The dequantized weight it multiplies by is exactly what the matmul uses (dequant: to fp32 rounding).
    if kernel == "dequant":
        assert torch.allclose(y, torch.nn.functional.linear(x, w_hat, b), atol=1e-5)


def test_update_weights_requantizes_and_the_update_shows_in_the_outputs():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    engine = NativeEngine(tiny_model("llama", seed=0), num_slots=512, eos_token_ids=[], quantization="int8")
    before = greedy(engine)
    fresh_b = NativeEngine(tiny_model("llama", seed=1), num_slots=512, eos_token_ids=[], quantization="int8")
    engine.update_weights((n, t.clone()) for n, t in b.state_dict().items())
    after = greedy(engine)
    assert after != before
    assert after == greedy(fresh_b)  # the same as quantizing b's weights from the start
    up = engine.runner.model.model.layers[1].mlp.up_proj
    assert isinstance(up, QuantLinear)
    w_b = b.model.layers[1].mlp.up_proj.weight
    assert ((up.dequantized() - w_b).abs() <= up.scale[:, None] / 2 * (1 + 1e-6)).all()
    assert (up.dequantized() - a.model.layers[1].mlp.up_proj.weight).abs().max() > 0.01


def test_released_quantized_weights_come_back_with_the_next_update():
    model = tiny_model("qwen2", seed=0)
    saved = {n: t.clone() for n, t in model.state_dict().items()}
    engine = NativeEngine(model, num_slots=512, eos_token_ids=[], quantization="int8", release_weights=True)
    before = greedy(engine)
    engine.sleep()
    assert engine.runner.weights_released and engine.runner.model.model.layers[0].self_attn.q_proj.qweight.numel() == 0
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.wake()
    engine.update_weights(list(saved.items()))
    engine.wake()
    assert greedy(engine) == before


def test_int8_generation_tracks_the_float_model_and_reports_weight_bytes():
    ref = tiny_model("qwen2")
    engine = NativeEngine(tiny_model("qwen2"), num_slots=1024, eos_token_ids=[], quantization="int8")
    gens = engine.generate(requests(SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=3)))
    assert len(gens) == 2 * len(PROMPTS) and all(len(g.token_ids) == 16 for g in gens)
    diffs = []
    for g in gens:
        ids = torch.tensor([g.prompt_token_ids + g.token_ids])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(g.prompt_token_ids) - 1 : -1]
        dense = processed_logprobs(logits, 1.0).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        diffs.append(torch.tensor(g.logp_sparse) - dense)
    d = torch.cat(diffs).abs()
    assert 1e-5 < d.mean() < 0.05  # a real, small mismatch from the int8 weights
    # Linear weights: 4 bytes -> 1 byte per entry plus one fp32 scale per output channel; the rest unchanged.
    linears = [m for m in ref.modules() if isinstance(m, torch.nn.Linear) and m is not ref.lm_head]
    entries, rows = sum(m.weight.numel() for m in linears), sum(m.weight.shape[0] for m in linears)
    float_bytes = sum(p.numel() * 4 for p in ref.parameters()) + sum(b.numel() * 4 for b in ref.buffers() if b.is_floating_point())
    extra = engine.stats().extra
    assert extra["rollout/weight_bytes"] == float_bytes - 3 * entries + 4 * rows
    assert extra["rollout/weight_bytes_saved"] == 3 * entries - 4 * rows


def test_int8_with_rkv_compression_and_the_dense_rescore_split():
    kv = KVPolicyConfig(algorithm="rkv", budget=16, divide_length=4, window=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=5)
    sparse = NativeEngine(tiny_model("llama"), num_slots=2048, eos_token_ids=[], quantization="int8", kv=kv, rescore_seqs=8)
    gens = sparse.generate(requests(params))
    assert all(len(g.token_ids) == 40 for g in gens)
    assert sum(g.kv.compressions for g in gens) > 0 and all(g.kv.retained_tokens <= 16 + 4 for g in gens)
    ex = sparse.stats().extra
    assert ex["rollout/rescored_tokens"] == 8 * 40
    assert abs(ex["rollout/kv_mismatch_kl"]) > 1e-4  # compression changed the sampler's log-probs
    # The same weights with a dense cache: the re-score reproduces the sampler, so the KV share is ~0 and the
    # whole mismatch against a float trainer is the weights'.
    dense = NativeEngine(tiny_model("llama"), num_slots=2048, eos_token_ids=[], quantization="int8", rescore_seqs=8)
    dense.generate(requests(params))
    assert abs(dense.stats().extra["rollout/kv_mismatch_kl"]) < 1e-5
    dense.reset_stats()
    assert "rollout/kv_mismatch_kl" not in dense.stats().extra and "rollout/weight_bytes" in dense.stats().extra


def tied_model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_tied_lm_head_is_requantized_from_the_embedding_name():
    a, b = tied_model(0), tied_model(1)
    engine = NativeEngine(a, num_slots=512, eos_token_ids=[], quantization="int8", quantize_lm_head=True)
    head = engine.runner.model.get_output_embeddings()
    assert isinstance(head, QuantLinear)
    assert type(engine.runner.model.get_input_embeddings()) is torch.nn.Embedding  # embeddings stay float
    engine.update_weights([(n, t) for n, t in b.state_dict().items() if n != "lm_head.weight"])
    w = b.model.embed_tokens.weight
    assert ((head.dequantized() - w).abs() <= head.scale[:, None] / 2 * (1 + 1e-6)).all()


def test_lm_head_stays_float_by_default():
    engine = NativeEngine(tiny_model("llama"), num_slots=64, eos_token_ids=[], quantization="int8")
    assert type(engine.runner.model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("overrides, message", [
    (["rollout.quantization=int4"], "rollout.quantization=int4: must be one of none, int8, w8a8, fp8"),
    (["rollout.quantization=w8a8", "parallel.device=cpu"], "rollout.quantization=w8a8 is not supported with parallel.device=cpu"),
    (["rollout.quantization=fp8", "parallel.device=cpu"], "rollout.quantization=fp8 is not supported with parallel.device=cpu"),
    (["rollout.rescore_seqs=-2"], "rollout.rescore_seqs=-2: must be >= 0"),
])
def test_bad_config_values_are_one_line_errors(overrides, message):
    with pytest.raises(UserError) as e:
        load_config(overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
def test_gpu_only_schemes_refuse_a_cpu_engine(scheme):
    with pytest.raises(UserError, match=f"rollout.quantization={scheme} is not supported on cpu") as e:
        check_scheme(scheme, torch.device("cpu"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=f"rollout.quantization={scheme}"):
        NativeEngine(tiny_model("llama"), num_slots=64, eos_token_ids=[], quantization=scheme)


def test_flash_rl_tis_preset_is_capped_is_only():
    c = load_config(["+preset=flash_rl_tis", "rollout.quantization=int8"]).algo.correction
    assert c.enable and c.mode == "apply" and c.is_cap == 2.0 and not c.is_batch_normalize
    assert c.veto is None and c.token_low is None and c.token_high is None and c.geo_low is None and c.geo_high is None
