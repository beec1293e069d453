"""Tensor parallelism (with and without FSDP2 data parallelism) reproduces the single-process update (fp32).

Tiny random checkpoints: Llama (separate LM head), Qwen2 (tied embeddings, attention biases) and Qwen3
(per-head q/k norms), all with GQA (4 query heads, 2 KV heads) and a padding_idx. Log-probs, the loss and
every parameter's gradient of one update must match the single-process run for (dp, tp) = (1, 2), (2, 1)
and (2, 2), and the LM head must be vocabulary-parallel whenever tp > 1.
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.launch import command

WORKER = Path(__file__).with_name("tp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256
REL = 1e-5


def launch(args, nproc, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = command(nproc, WORKER, *args)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    root = tmp_path_factory.mktemp("tp")
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=3)
    configs = {
        "llama": LlamaConfig(**common, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, head_dim=16, tie_word_embeddings=False),
    }
    for i, (family, cfg) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg)
        if family == "qwen3":  # norms start at 1: perturb them so their gradients are not symmetric
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / family)
    return root


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).norm() <= REL * ref.norm().clamp(min=1e-12))


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp_ref") / "ref.pt"
    launch(["model", out, checkpoints, 1, 1, "llama", "qwen2", "qwen3"], nproc=1)
    return torch.load(out)


@pytest.mark.parametrize("dp, tp, families", [
    (1, 2, ("llama", "qwen2", "qwen3")),
    (2, 1, ("llama", "qwen2")),
    (2, 2, ("qwen2",)),  # 4 processes on a small machine: the one family with tied embeddings
])
def test_matches_single_process(checkpoints, reference, tmp_path, dp, tp, families):
    out = tmp_path / "got.pt"
    launch(["model", out, checkpoints, dp, tp, *families], nproc=dp * tp)
    results = torch.load(out)
    for family in families:
        ref, got = reference[family], results[family]
        assert ref["dense_calls"] > 0 and not ref["widths"]
        if tp > 1:  # every log-prob went through the vocabulary-parallel path on V/tp columns
            assert got["dense_calls"] == 0 and got["widths"] and set(got["widths"]) == {VOCAB // tp}, (family, got["widths"])
        # log-probs: dp shares in order; the tp ranks of one share agree
        shares = {}
        for dp_rank, _, logp in got["logp"]:
            if dp_rank in shares:
                assert torch.allclose(shares[dp_rank], logp, rtol=0, atol=1e-6), (family, "tp ranks disagree")
            shares[dp_rank] = logp
        logp = torch.cat([shares[r] for r in range(dp)])
        ref_logp = reference[family]["logp"][0][2]
        assert logp.shape == ref_logp.shape and close(logp, ref_logp), (family, float((logp - ref_logp).abs().max()))
        assert ref_logp.abs().sum() > 0
        for agg in ("token", "sequence"):
            assert abs(got["loss"][agg] - ref["loss"][agg]) <= REL * abs(ref["loss"][agg]), (family, agg, got["loss"][agg], ref["loss"][agg])
            assert set(got["grads"][agg]) == set(ref["grads"][agg])
            for name, g in ref["grads"][agg].items():
                assert got["grads"][agg][name].shape == g.shape
                assert close(got["grads"][agg][name], g), (family, agg, name, float((got["grads"][agg][name] - g).norm() / g.norm()))
            assert all(g.abs().sum() > 0 for g in ref["grads"][agg].values()), (family, agg, "a parameter got no gradient")
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= REL * ref["grad_norm"]


def test_vocab_parallel_logprobs_match_dense_without_gathering_the_vocabulary(tmp_path):
    launch(["vocab", tmp_path / "vocab"], nproc=2)
    ranks = [torch.load(tmp_path / f"vocab.{r}.pt") for r in range(2)]
    N, V = 7, 51
    assert [(r["start"], r["end"]) for r in ranks] == [(0, 26), (26, 51)]
    for temperature in (1.0, 0.7, 0.0):
        g = torch.Generator().manual_seed(1)
        full = (torch.randn(N, V, generator=g) * 3).requires_grad_(True)
        targets = torch.randint(0, V, (N,), generator=g)
        a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
        logp_all = torch.log_softmax(full / (temperature or 1.0), dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        ((a * logp).sum() + (b * ent).sum()).backward()
        assert {int(t) < 26 for t in targets} == {True, False}  # targets owned by both ranks
        for r in ranks:
            run = r["runs"][temperature]
            assert run["local_width"] == r["end"] - r["start"] < V
            # Only per-row numbers cross ranks: no collective carries a vocabulary-sized tensor.
            assert run["shapes"] and all(s[-1] == N and len(s) <= 2 and (len(s) == 1 or s[0] <= 3) for s in run["shapes"]), run["shapes"]
            torch.testing.assert_close(run["logp"], logp.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(run["only_logp"], logp.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(run["ent"], ent.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(run["grad"], full.grad[:, r["start"]:r["end"]], rtol=1e-5, atol=1e-6)
            assert run["none"]


def test_unknown_model_type_names_the_supported_ones():
    from transformers import GPT2Config

    from sparserl.actor.tp_plans import tp_plan

    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama, qwen2, qwen3"):
        tp_plan(GPT2Config())
