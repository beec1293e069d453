"""Context parallelism in the actor (parallel.cp): one update with cp > 1 equals the cp = 1 update (fp32, 1e-5).

Real gloo process groups (torchrun) on a tiny random Llama (GQA, 4 query / 2 KV heads): per-token log-probs,
losses (token and sequence aggregation with an entropy term), every parameter's gradient, the fused path
(logp_old from the update's own forward, correction applied, its metrics), the clipped gradient norm and the
log-probs after the optimizer step, for (dp, cp, tp) = (1, 2, 1), (1, 3, 1), (2, 2, 1) and (1, 2, 2) against (1, 1, 1), and at cp = 3 on SmolLM2's
head shape (9 query / 3 KV heads, tied embeddings).
The batch packs uneven sequences, groups sharing a prompt and a one-token response; max_tokens splits it into
several micro-batches, some of whose rows are shorter than 2 x cp.
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.launch import command

WORKER = Path(__file__).with_name("cp_actor_worker.py")
ROOT = Path(__file__).resolve().parents[2]
REL = 1e-5
MAX_TOKENS = 40


def launch(args, nproc, timeout=400):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = command(nproc, WORKER, *args)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]


def tiny_llama(root: Path, heads: int, kv_heads: int, head_dim: int, tie: bool) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    return root


def one_process(checkpoint: Path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp_ref") / "ref.pt"
    launch([out, checkpoint, 1, 1, 1, MAX_TOKENS], nproc=1)
    return torch.load(out)[0][2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("cp") / "llama", heads=4, kv_heads=2, head_dim=16, tie=False)


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory) -> dict:
    return one_process(checkpoint, tmp_path_factory)


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).norm() <= REL * ref.norm().clamp(min=1e-12))


def by_dp(everyone, key, dp):
    """Every rank's `key`: the cp (and tp) ranks of a DP rank agree; the DP shares are concatenated in order."""
    shares = {}
    for dp_rank, _, res in everyone:
        if dp_rank in shares:
            torch.testing.assert_close(res[key], shares[dp_rank], rtol=0, atol=1e-6)
        shares[dp_rank] = res[key]
    return torch.cat([shares[r] for r in range(dp)])


@pytest.mark.parametrize("dp, cp, tp", [(1, 2, 1), (1, 3, 1), (2, 2, 1), (1, 2, 2)])
def test_update_matches_cp1(checkpoint, reference, tmp_path, dp, cp, tp):
    out = tmp_path / "got.pt"
    launch([out, checkpoint, dp, cp, tp, MAX_TOKENS], nproc=dp * cp * tp)
    assert_same_update(torch.load(out), reference, dp)


def test_smollm2_head_shape_matches_cp1(tmp_path_factory, tmp_path):
    """SmolLM2-135M's attention shape (9 query heads sharing 3 KV heads, tied embeddings) at cp = 3, the degree
    its 9 and 3 heads divide (the ring itself needs no head condition)."""
    ckpt = tiny_llama(tmp_path_factory.mktemp("cp93") / "llama", heads=9, kv_heads=3, head_dim=8, tie=True)
    ref = one_process(ckpt, tmp_path_factory)
    out = tmp_path / "got.pt"
    launch([out, ckpt, 1, 3, 1, MAX_TOKENS], nproc=3)
    assert_same_update(torch.load(out), ref, 1)


def assert_same_update(everyone, ref: dict, dp: int) -> None:
    for key in ("logp", "after"):
        got = by_dp(everyone, key, dp)
        assert got.shape == ref[key].shape and close(got, ref[key]), (key, float((got - ref[key]).abs().max()))
    assert not torch.equal(ref["logp"], ref["after"])  # the step changed the weights
    assert ref["ring_calls"] == 0
    for _, _, res in everyone:
        assert res["ring_calls"] > 0  # every attention layer ran the ring on this rank's share of the rows
        for name, sums in ref["loss"].items():
            for g, r in zip(res["loss"][name], sums):
                assert abs(g - r) <= REL * max(abs(r), 1e-6), (name, res["loss"][name], sums)
            for pname, g in ref["grads"][name].items():
                assert close(res["grads"][name][pname], g), (name, pname, float((res["grads"][name][pname] - g).norm() / g.norm()))
            assert all(g.abs().sum() > 0 for g in ref["grads"][name].values()), (name, "a parameter got no gradient")
        assert res["fused_metrics"].keys() == ref["fused_metrics"].keys()
        for k, v in ref["fused_metrics"].items():
            assert abs(res["fused_metrics"][k] - v) <= REL * max(abs(v), 1e-6), (k, res["fused_metrics"][k], v)
        assert abs(res["grad_norm"] - ref["grad_norm"]) <= REL * ref["grad_norm"]


def test_activation_checkpointing_with_cp(checkpoint, reference, tmp_path):
    """Activation checkpointing recomputes each layer's ring attention in backward: the same update."""
    out = tmp_path / "got.pt"
    launch([out, checkpoint, 1, 2, 1, MAX_TOKENS, "ac"], nproc=2)
    for _, _, res in torch.load(out):
        for pname, g in reference["grads"]["token"].items():
            assert close(res["grads"]["token"][pname], g), pname
