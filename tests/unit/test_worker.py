"""The env loop over a real (tiny, random) model and the real SmolLM2 tokenizer.

`ForwardEngine` below is a deliberately plain engine: one full forward per token, sampling with a seeded
generator, log-probs of the processed distribution. It checks the worker against a model, not against
canned outputs; the native engine runs the same multi-turn check where it is available.
"""
from __future__ import annotations

import textwrap
import zlib

import pytest
import torch

from sparserl.data.dataset import PromptRow, format_prompt
from sparserl.engines.types import Generation, KVStats, SamplingParams
from sparserl.rollout.worker import rollout
from sparserl.utils.envload import load_env

OBS = "\n<|im_start|>user\nTry once more.<|im_end|>\n<|im_start|>assistant\n"

MULTI_TURN_ENV = f'''
max_turns = 3
OBS = {OBS!r}

async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0) + 1
    info = {{**extra_info, "turn": turn}}
    if turn >= 2:
        return {{"next_state": None, "reward": 1.0, "score": 7.0, "done": True, "extra_info": info}}
    return {{"next_state": state + action + OBS, "reward": 0.5, "score": 0.0, "done": False, "extra_info": info}}
'''

FAILING_ENV = '''
async def step(state, action, extra_info):
    if extra_info["index"] == 1:
        raise RuntimeError("env exploded on purpose")
    return {"next_state": None, "reward": 1.0, "done": True, "extra_info": extra_info}
'''

RESET_ENV = """
async def reset(extra_info):
    return "<|im_start|>user\\nCount to " + str(extra_info["index"]) + "<|im_end|>\\n<|im_start|>assistant\\n"

async def step(state, action, extra_info):
    return {"next_state": None, "reward": float(state.startswith("<|im_start|>user\\nCount to ")), "done": True}
"""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is latency-bound: a second OpenMP thread only adds synchronisation (50x slower on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


class ForwardEngine:
    """Minimal `RolloutEngine`: full forward per token, seeded sampling, stop tokens/strings, `n` expansion."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.calls = model, tokenizer, []

    @torch.no_grad()
    def generate(self, requests, progress=None):
        self.calls.append(requests)
        out = []
        for req in requests:
            p = req.params
            for j in range(p.n):
                # zlib, not hash(): str hashes change with every process (PYTHONHASHSEED), and so would the draws
                key = f"{p.seed}/{req.request_id}/{j}/{len(req.prompt_token_ids)}".encode()
                gen = torch.Generator().manual_seed(zlib.crc32(key))
                ids, logps, reason = list(req.prompt_token_ids), [], "length"
                for _ in range(p.max_new_tokens):
                    logits = self.model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
                    lp = torch.log_softmax(logits / p.temperature, -1)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                    ids.append(tok)
                    logps.append(float(lp[tok]))
                    tail = self.tokenizer.decode(ids[len(req.prompt_token_ids):])
                    if tok in p.stop_token_ids or any(s in tail for s in p.stop_strings):
                        reason = "stop"
                        break
                out.append(Generation(req.request_id, j, list(req.prompt_token_ids), ids[len(req.prompt_token_ids):], logps, reason,
                                      kv=KVStats(total_tokens=len(ids))))
        return out

    def update_weights(self, named_tensors): ...
    def sleep(self): ...
    def wake(self): ...
    def stats(self): ...
    def reset_stats(self): ...


def _rows(tokenizer, n_rows=3):
    rows = [PromptRow(prompt=f"What is {i} + {i + 1}?", answer=str(2 * i + 1), extra={"tag": i}, index=i) for i in range(n_rows)]
    return rows, [format_prompt(r, tokenizer) for r in rows]


def _write_env(tmp_path, source, name):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return load_env(str(path))


def dense_logprobs(model, sample, temperature):
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def _check_multi_turn(samples, metrics, tokenizer, model, params, n_rows):
    obs_ids = tokenizer.encode(OBS, add_special_tokens=False)
    assert [s.group for s in samples] == [g for g in range(n_rows) for _ in range(params.n)]  # contiguous groups of n
    two_turns = [s for s in samples if s.num_turns == 2]
    assert two_turns, "no trajectory reached the second turn"
    for s in samples:
        assert len(s.response_ids) == len(s.loss_mask) == len(s.logp_sparse) and len(s.kv) == s.num_turns
        assert all(lp == 0.0 for lp, m in zip(s.logp_sparse, s.loss_mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(s.logp_sparse, s.loss_mask) if m == 1)
        # Model tokens carry the sampler's log-prob given the full history, env tokens included.
        dense = dense_logprobs(model, s, params.temperature)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert torch.allclose(dense[mask], torch.tensor(s.logp_sparse)[mask], atol=1e-4)
        if s.num_turns == 2:
            assert s.status == "ok" and s.reward == pytest.approx(1.5) and s.score == 7.0 and s.extra_info["turn"] == 2
            assert s.extra_info["tag"] == s.group and s.extra_info["answer"] == str(2 * s.group + 1)
            n1 = s.loss_mask.index(0)
            assert s.response_ids[n1 : n1 + len(obs_ids)] == obs_ids
            assert s.loss_mask == [1] * n1 + [0] * len(obs_ids) + [1] * (len(s.loss_mask) - n1 - len(obs_ids))
        else:  # cut by max_new_tokens at turn 1: scored, not continued
            assert s.status == "truncated" and s.num_turns == 1 and set(s.loss_mask) == {1} and s.reward == 0.5
    assert metrics["env/turns_mean"] == pytest.approx(sum(s.num_turns for s in samples) / len(samples))
    assert metrics["env/error_frac"] == 0.0
    assert metrics["reward/mean"] == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert metrics["response/len_max"] == max(len(s.response_ids) for s in samples)


def test_multi_turn_masks_logps_and_groups(tmp_path, tokenizer, model):
    env = _write_env(tmp_path, MULTI_TURN_ENV, "two_turns")
    rows, texts = _rows(tokenizer)
    engine = ForwardEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=1, stop_strings=("e",))
    samples, metrics = rollout(engine, tokenizer, env, rows, texts, params)
    _check_multi_turn(samples, metrics, tokenizer, model, params, len(rows))
    # Turn 1: one request per prompt with n samples; turn 2: one n=1 request per trajectory, history as prompt.
    assert [r.params.n for r in engine.calls[0]] == [3, 3, 3]
    assert all(r.params.n == 1 for r in engine.calls[1]) and len(engine.calls[1]) == sum(s.num_turns == 2 for s in samples)
    assert len(engine.calls) == 2


def test_multi_turn_with_native_engine(tmp_path, tokenizer, model):
    native = pytest.importorskip("sparserl.engines.native.engine", reason="the native engine is not importable yet")
    env = _write_env(tmp_path, MULTI_TURN_ENV, "two_turns_native")
    rows, texts = _rows(tokenizer)
    engine = native.NativeEngine(model, tokenizer, num_slots=4096, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=1, stop_strings=("e",))
    samples, metrics = rollout(engine, tokenizer, env, rows, texts, params)
    _check_multi_turn(samples, metrics, tokenizer, model, params, len(rows))


def test_env_error_costs_one_group_only(tmp_path, tokenizer, model, caplog):
    env = _write_env(tmp_path, FAILING_ENV, "failing")
    rows, texts = _rows(tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=0)
    with caplog.at_level("WARNING"):
        samples, metrics = rollout(ForwardEngine(model, tokenizer), tokenizer, env, rows, texts, params)
    assert [(s.group, s.status, s.reward) for s in samples if s.group == 1] == [(1, "error", 0.0)] * 2
    assert all(s.reward == 1.0 and s.status in ("ok", "truncated") for s in samples if s.group != 1)
    assert metrics["env/error_frac"] == pytest.approx(2 / 6)
    assert metrics["reward/mean"] == pytest.approx(4 / 6)
    warnings = [r for r in caplog.records if "env.step failed" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: env exploded on purpose" in warnings[0].getMessage()
    assert "Traceback" not in caplog.text


def test_max_total_tokens_truncates(tmp_path, tokenizer, model):
    env = _write_env(tmp_path, MULTI_TURN_ENV, "two_turns_budget")
    rows, texts = _rows(tokenizer, 2)
    prompt_len = len(tokenizer.encode(texts[0], add_special_tokens=False))
    params = SamplingParams(temperature=1.0, max_new_tokens=50, n=2, seed=3)
    samples, metrics = rollout(ForwardEngine(model, tokenizer), tokenizer, env, rows, texts, params, max_total_tokens=prompt_len + 6)
    for s in samples:
        assert len(s.prompt_ids) + len(s.response_ids) <= prompt_len + 6
        assert s.status == "truncated" and s.num_turns == 1
    assert metrics["response/truncated_frac"] == 1.0


def test_reset_replaces_the_prompt(tmp_path, tokenizer, model):
    env = _write_env(tmp_path, RESET_ENV, "with_reset")
    rows, texts = _rows(tokenizer, 2)
    samples, metrics = rollout(ForwardEngine(model, tokenizer), tokenizer, env, rows, texts, SamplingParams(max_new_tokens=3, n=2, seed=0))
    for s in samples:
        assert tokenizer.decode(s.prompt_ids) == f"<|im_start|>user\nCount to {s.group}<|im_end|>\n<|im_start|>assistant\n"
    assert metrics["reward/mean"] == 1.0 and metrics["score/mean"] == 1.0  # score defaults to the reward


def test_load_env_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"env\.path=.*missing\.py"):
        load_env(str(tmp_path / "missing.py"))
    (tmp_path / "sync_step.py").write_text("def step(state, action, extra_info):\n    return {}\n")
    with pytest.raises(TypeError, match="must be an async function"):
        load_env(str(tmp_path / "sync_step.py"))
    (tmp_path / "no_step.py").write_text("x = 1\n")
    with pytest.raises(AttributeError, match="must define `async def step"):
        load_env(str(tmp_path / "no_step.py"))


HANGING_ENV = '''
import asyncio

active = peak = 0

async def reset(extra_info):
    if extra_info["index"] == 2:
        await asyncio.sleep(3600)  # this episode never starts
    return None

async def step(state, action, extra_info):
    global active, peak
    active += 1
    peak = max(peak, active)
    try:
        if extra_info["index"] == 1:
            await asyncio.sleep(3600)  # hangs: only env.step_timeout_s ends it
        await asyncio.sleep(0.05)
    finally:
        active -= 1
    return {"next_state": None, "reward": 1.0, "done": True, "extra_info": {**extra_info, "peak": peak}}
'''


def test_hung_env_calls_time_out_and_concurrency_is_capped(tmp_path, tokenizer, model, caplog):
    """A hung step or reset ends its samples with status timeout within env.step_timeout_s; the rest are scored;
    no more than env.max_concurrency calls are in flight at once."""
    import time

    env = _write_env(tmp_path, HANGING_ENV, "hanging")
    rows, texts = _rows(tokenizer, n_rows=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=0)
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        samples, metrics = rollout(ForwardEngine(model, tokenizer), tokenizer, env, rows, texts, params,
                                   step_timeout_s=1.0, max_concurrency=2)
    assert time.perf_counter() - t0 < 60
    status = {g: [s.status for s in samples if s.group == g] for g in range(4)}
    assert status[1] == ["timeout"] * 2 and status[2] == ["timeout"] * 2
    assert all(s.reward == 1.0 and s.status in ("ok", "truncated") for s in samples if s.group in (0, 3))
    assert all(not s.response_ids for s in samples if s.group == 2)  # never generated: its reset hung
    assert metrics["env/timeout_frac"] == pytest.approx(4 / 8) and metrics["env/error_frac"] == 0.0
    peaks = [s.extra_info["peak"] for s in samples if s.group in (0, 3)]
    assert max(peaks) == 2  # four steps of 50 ms (plus the hung ones) ran two at a time, never three
    messages = [r.getMessage() for r in caplog.records]
    assert any("did not return within env.step_timeout_s=1" in m for m in messages)
