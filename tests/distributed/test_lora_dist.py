"""LoRA actors sharded for real: 1 process against 2 (gloo), on a (dp=2, tp=1) and a (dp=1, tp=2) mesh.

The worker (lora_worker.py) trains an fp32 LoRA actor with activation checkpointing. Here: only the adapters train
and only they are in the optimizer; the reference (adapters off) is the base model; after two updates the merged
full state of every mesh equals one process's, and a native engine given those weights through `sync_weights`
reports the actor's log-probs on its own samples (the dense parity, 1e-5); a checkpoint holds only the adapters
and resuming from it gives the same next step, bitwise; the export is a peft adapter folder plus the merged model.
Then a 2-process training run with LoRA, a KL reference and dense rollouts: parity through the whole loop, and
`python -m sparserl.eval` on its adapter export, its run folder and its checkpoint, which all merge to the same
weights.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.launch import command

WORKER = Path(__file__).with_name("lora_worker.py")
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}


def launch(args: list[str], nproc: int, module: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    target = ["-m", *args] if module else args
    cmd = command(nproc, *target)
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("lora") / "llama"
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms start at 1: make every tensor distinct
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def test_lora_actor_fsdp_tp_parity_resume_export(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    one = launch([str(WORKER), str(base), str(tmp_path / "one" / "out.pt")], 1)
    one = torch.load(tmp_path / "one" / "out.pt", weights_only=False)[(1, 1)][0]
    launch([str(WORKER), str(base), str(tmp_path / "two" / "out.pt")], 2)
    two = torch.load(tmp_path / "two" / "out.pt", weights_only=False)
    assert not any(torch.equal(one["merged"][k], v) for k, v in AutoModelForCausalLM.from_pretrained(base).state_dict().items()
                   if k.endswith("proj.weight")), "the updates left some adapted weight unchanged"
    for mesh, ranks in [((1, 1), [one]), *two.items()]:
        for rank, res in enumerate(ranks):
            where = (mesh, rank)
            assert len(res["trained"]) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in res["trained"]), where
            assert res["optimizer_is_adapters"] and res["frozen"] == 21, where
            assert res["checkpoint_keys"] and all(".lora_A." in k or ".lora_B." in k for k in res["checkpoint_keys"]), where
            assert len(res["checkpoint_keys"]) == len(res["trained"]), where
            assert torch.equal(res["logp_ref"], res["logp_base"]), where  # adapters off: the initial policy
            assert not torch.allclose(res["logp"], res["logp_base"]), where
            assert res["parity"] < 1e-5, (where, res["parity"])
            assert res["resumed"].keys() == res["adapters"].keys(), where
            assert all(torch.equal(res["resumed"][k], v) for k, v in res["adapters"].items()), where
            assert res["merged"].keys() == one["merged"].keys(), where
            for k, v in one["merged"].items():
                torch.testing.assert_close(res["merged"][k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} {k}: {m}")
            torch.testing.assert_close(res["logp"], one["logp"], rtol=1e-5, atol=1e-5)
        if mesh == (1, 2) or mesh == (1, 1):
            hf = Path(ranks[0]["export"])
            assert sorted(p.name for p in hf.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "merged"]
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(hf)).merge_and_unload()
            merged = AutoModelForCausalLM.from_pretrained(hf / "merged").state_dict()
            for k, v in ranks[0]["merged"].items():
                torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=1e-6)
                assert torch.equal(merged[k], v), k


def test_lora_training_run_parity_reference_export_and_eval(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from sparserl.eval.model import resolve_eval_model

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}) + "\n"
                            for a, b in [(1, 1), (2, 3), (4, 4), (5, 1)]))
    out = tmp_path / "run"
    args = {"model.path": tiny_checkpoint, "model.compute_dtype": "float32", "rollout.dtype": "float32",
            "data.train_path": data, "env.path": "envs/arithmetic.py", "trainer.output_dir": out, "trainer.total_steps": 2,
            "trainer.prompts_per_step": 4, "rollout.n": 2, "rollout.max_new_tokens": 8, "actor.lr": 1e-2,
            "actor.max_tokens_per_device": 256, "algo.entropy_coef": 0.01, "+preset": "dense", "algo.correction.enable": "true",
            "actor.lora.rank": 4, "actor.lora.export_merged": "true", "algo.kl.coef": 0.01}
    launch(["sparserl.trainer.grpo", *[f"{k}={v}" for k, v in args.items()]], 2, module=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # step 2 rolls out with the merged weights of step 1's update
        assert abs(m["mismatch/kl"]) < 1e-5 and m["mismatch/abs_max"] < 1e-4, m
        assert m["actor/grad_norm"] > 0
    assert metrics[1]["actor/kl"] > 0  # the reference is the base model, the policy has moved
    hf = out / "hf"
    assert (hf / "adapter_config.json").exists() and (hf / "merged" / "config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(hf / "merged").state_dict()
    for given in (hf, out, out / "checkpoints" / "step_000002"):  # the adapter folder, the run, its checkpoint
        weights = dict(resolve_eval_model(str(given)).weights())
        assert weights.keys() == merged.keys(), given
        for k, v in weights.items():
            torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6, msg=lambda m: f"{given} {k}: {m}")
    res = launch(["sparserl.eval", f"model.path={hf}", "eval.datasets=[mawps]", "eval.limit=2", "eval.n=1", "eval.k=[1]",
                  "eval.max_new_tokens=4", "rollout.dtype=float32", f"eval.output_dir={tmp_path / 'eval'}"], 1, module=True)
    assert f"evaluating {hf}" in res.stdout + res.stderr and (tmp_path / "eval" / "eval.json").exists()
