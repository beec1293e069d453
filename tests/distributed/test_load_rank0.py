"""Reading the checkpoint on rank 0 only gives the same actor as reading it on every rank, and as one process.

Tiny random checkpoints saved here: Llama (separate LM head, rotary buffers with a non-default base) and
Qwen2 (tied embeddings, attention biases), both with a padding_idx, loaded in fp32 and (Llama) bf16. With 2
processes, on a (dp=2, tp=1) and a (dp=1, tp=2) mesh: log-probs, every full tensor, the non-persistent
buffers, and all of them again after one update are bitwise those of `load_on="all"`, the weights and buffers
are bitwise the one-process actor's, and ranks other than 0 never read the checkpoint. The export written
from 2 processes loads back as the actor's weights, and `sync_weights` gathers in the engine's dtype and
hands tensors only to engines that receive them.
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.launch import command

WORKER = Path(__file__).with_name("load_worker.py")
ROOT = Path(__file__).resolve().parents[2]
SPECS = ("llama:float32", "qwen2:float32", "llama:bfloat16")


def launch(root: Path, out: Path, nproc: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("SPARSERL_LOAD_ON", None)
    args = [str(WORKER), str(root), str(out), *SPECS]
    cmd = command(nproc, *args)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    root = tmp_path_factory.mktemp("load_rank0")
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=3)
    configs = {"llama": LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
               "qwen2": Qwen2Config(**common, tie_word_embeddings=True)}
    for i, (family, cfg) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor distinct
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / family)
    return root


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_rank0_load_export_and_weight_sync(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    one = launch(checkpoints, tmp_path / "one.pt", 1)
    two = launch(checkpoints, tmp_path / "two.pt", 2)
    for spec in SPECS:
        family, dtype = spec.split(":")
        ref = one[(family, dtype, 1, 1)][0]["rank0"]
        assert ref["buffers"] and "model.rotary_emb.inv_freq" in ref["buffers"]
        assert not same(ref["state"], ref["updated"]), "the update changed nothing"
        # bf16 weights, fp32 compute paths differ between one process and a mesh only by summation order
        tol = 1e-5 if dtype == "float32" else 2e-2
        for dp, tp in ((2, 1), (1, 2)):
            ranks = two[(family, dtype, dp, tp)]
            for rank, res in enumerate(ranks):
                where = (spec, dp, tp, rank)
                got, every = res["rank0"], res["all"]
                assert res["tied"] == (family == "qwen2"), where
                assert res["param_dtypes"] == [f"torch.{dtype}"], (where, res["param_dtypes"])
                # rank 0 only == every rank, bitwise, before and after an update
                for key in ("state", "buffers", "updated"):
                    assert same(got[key], every[key]), (where, key)
                for key in ("logp", "logp_updated"):
                    assert torch.equal(got[key], every[key]), (where, key)
                assert got["grad_norm"] == every["grad_norm"], where
                # == one process: the same checkpoint values and buffers; the same log-probs up to summation order
                assert same(got["state"], ref["state"]) and same(got["buffers"], ref["buffers"]), where
                torch.testing.assert_close(got["logp"], ref["logp"], rtol=tol, atol=tol)
                assert abs(got["grad_norm"] - ref["grad_norm"]) <= tol * ref["grad_norm"], where
            if (dp, tp) != (1, 2):
                continue
            # export from 2 processes: loads back as the actor's weights at export time (after the update)
            exported = AutoModelForCausalLM.from_pretrained(ranks[0]["export"], dtype=getattr(torch, dtype)).state_dict()
            assert same({k: exported[k] for k in ranks[0]["rank0"]["updated"]}, ranks[0]["rank0"]["updated"]), spec
            # sync_weights: a bf16 engine on rank 0 gets the bf16 casts; rank 1 (receives_weights=False) gets nothing
            fake0, fake1 = ranks[0]["fake"], ranks[1]["fake"]
            assert same(fake0["got"], fake0["expect"]), spec
            assert all(t.dtype == torch.bfloat16 for t in fake0["got"].values())
            ratio = 2 if dtype == "float32" else 1
            assert fake0["gb"] == pytest.approx(fake0["full_bytes"] / ratio / 2**30), spec
            assert fake1["got"] == {} and fake1["gb"] == 0.0, spec
            for res in ranks:  # a bf16 native engine on every rank
                assert res["native"]["dtype"] == "torch.bfloat16" and res["native"]["equal"], (spec, res["native"])
                assert res["native"]["gb"] == pytest.approx(fake0["gb"])
