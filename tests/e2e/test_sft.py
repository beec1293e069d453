"""Tiny runs of `sparserl.trainer.sft`: env examples and a JSONL file, export, finite loss, bad input, and a
context-parallel run (torchrun, parallel.cp=2) equal to the one-process run."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]


def sft(args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    return subprocess.run(command(1, "-m", "sparserl.trainer.sft", *args), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def tiny_args(ckpt, out, **extra):
    args = {"model.path": ckpt, "model.compute_dtype": "float32", "env.path": "envs/recall.py", "data.train_path": "",
            "data.num_generated": 16, "trainer.output_dir": out, "trainer.total_steps": 2, "trainer.prompts_per_step": 4,
            "actor.lr": 1e-3, "actor.max_tokens_per_device": 512}
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def test_sft_on_env_examples_exports_a_loadable_policy(tiny_checkpoint, tmp_path):
    out = tmp_path / "sft"
    res = sft(tiny_args(tiny_checkpoint, out, **{"rollout.max_new_tokens": 7}))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/loss"] is not None and math.isfinite(m["actor/loss"]) and m["actor/loss"] > 0
        assert m["actor/grad_norm"] > 0
    assert "step 2/2 | loss" in res.stdout
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    diffs = [(a - b).abs().max().item() for a, b in zip(trained.state_dict().values(), initial.state_dict().values())]
    assert max(diffs) > 0, "the exported policy is the initial one"
    assert (out / "hf" / "tokenizer.json").exists() and (out / "config.yaml").exists()
    assert_eval_takes_no_sampling_setting(out)


def assert_eval_takes_no_sampling_setting(out: Path) -> None:
    """The run's config.yaml has the GRPO keys it never used (rollout.max_new_tokens=7 here): the evaluation of its
    folder samples with eval's own length cap, and says why."""
    from sparserl.config.load import load_config
    from sparserl.eval.run_settings import take_run_settings

    argv = [f"model.path={out / 'hf'}", "eval.max_new_tokens=200"]
    cfg, said = take_run_settings(load_config(argv, "eval"), argv)
    assert cfg.eval.max_new_tokens == 200 and cfg.rollout.kv.algorithm == "none", cfg.eval
    assert len(said) == 1 and "an SFT run's config: it sampled nothing" in said[0], said
    # The same folder as a GRPO run's (the first line gone) would hand its unused length cap to eval.
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text.split("\n", 1)[1])
    cfg, _ = take_run_settings(load_config(argv[:1], "eval"), argv[:1])
    assert cfg.eval.max_new_tokens == 7


@pytest.mark.slow
def test_sft_on_a_jsonl_file_and_bad_rows(tiny_checkpoint, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "response": f"{i}"} for i in range(3)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "file"
    res = sft(tiny_args(tiny_checkpoint, out, **{"data.train_path": data, "trainer.total_steps": 1}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "hf" / "config.json").exists()

    data.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "no response here"}) + "\n")
    never = tmp_path / "never"
    res = sft(tiny_args(tiny_checkpoint, never, **{"data.train_path": data}))
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "row 1" in last and "'response'" in last, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not never.exists()


@pytest.mark.slow
def test_sft_with_context_parallelism_equals_one_process(tiny_checkpoint, tmp_path):
    """torchrun with parallel.cp=2: every example split over two ranks (ring attention) trains exactly like one
    process: the same losses, gradient norms and exported weights, to 1e-5. (A small lr: AdamW divides by
    sqrt(v), which turns last-bit gradient differences on near-zero entries into lr-sized weight steps.)"""
    runs = {}
    for name, nproc in (("one", 1), ("cp2", 2)):
        out = tmp_path / name
        args = tiny_args(tiny_checkpoint, out, **{"parallel.cp": nproc, "trainer.total_steps": 3, "actor.lr": 1e-4,
                                                   "model.activation_checkpointing": False,
                                                   "trainer.prompts_per_step": 16, "actor.max_tokens_per_device": 64})
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
        res = subprocess.run(command(nproc, "-m", "sparserl.trainer.sft", *args), env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "cp=2" in res.stdout
    for ref, got in zip(runs["one"], runs["cp2"], strict=True):
        for key in ("actor/loss", "actor/target_prob", "actor/grad_norm", "actor/lr"):
            assert abs(ref[key] - got[key]) <= 1e-5 * max(abs(ref[key]), 1e-6), (ref["step"], key, ref[key], got[key])
    assert runs["one"][0]["actor/loss"] > runs["one"][-1]["actor/loss"]  # it learned something
    # Step 1 (every example, several micro-batches) is the initial model's mean cross-entropy over target tokens.
    assert abs(runs["one"][0]["actor/loss"] - mean_target_ce(tiny_checkpoint, args)) < 1e-5
    from transformers import AutoModelForCausalLM

    one = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf").state_dict()
    cp2 = AutoModelForCausalLM.from_pretrained(tmp_path / "cp2" / "hf").state_dict()
    for k, v in one.items():
        assert (cp2[k] - v).abs().max() <= 1e-5 * max(1.0, float(v.abs().max())), k


def mean_target_ce(ckpt, args) -> float:
    """The mean cross-entropy over every example's target tokens under `ckpt`, by a plain Hugging Face forward."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparserl.config.load import load_config
    from sparserl.trainer.sft import read_examples, tokenize_examples

    cfg = load_config(args)
    records, source = read_examples(cfg)
    examples = tokenize_examples(cfg, records, source, AutoTokenizer.from_pretrained(ckpt))
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            logits = model(torch.tensor([e.ids])).logits[0, e.prompt_len - 1 : -1]
            total += float(F.cross_entropy(logits.float(), torch.tensor(e.ids[e.prompt_len :]), reduction="sum"))
            count += len(e.ids) - e.prompt_len
    return total / count
