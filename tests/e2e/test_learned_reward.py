"""`env.reward_model.path`: a 2-process GRPO run (gloo) whose reward adds a reward model's score to the env's
(`env.reward_model.mode=add`), the scorer sharded over both ranks like the actor. The reward model is a tiny
Hugging Face `LlamaForSequenceClassification` (num_labels=1) with the policy's tokenizer, the format
`sparserl.trainer.rm` exports; each logged sample's reward must be its env reward plus that model's own score of
the sequence (Hugging Face's class, the prompt and the response without its end-of-sequence token), and the
reward_model/ metrics must agree with reward/mean."""
import json
import math

import pytest
import torch

from tests.e2e.test_objectives import parity_task
from tests.e2e.test_trainer import read_metrics, tiny_args, trainer


@pytest.fixture(scope="module")
def reward_model(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_checkpoint)
    config.num_labels = 1
    torch.manual_seed(1)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # scores of a few units, so that they move the reward visibly
        model.score.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("rm") / "hf"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(path)
    return path


def test_a_reward_model_scores_every_sample_of_a_two_process_run(tiny_checkpoint, reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data, env = parity_task(tmp_path)
    out = tmp_path / "run"
    args = tiny_args(tiny_checkpoint, data, env, out, **{"env.reward_model.path": reward_model,
                                                         "env.reward_model.mode": "add", "trainer.log_samples": 4,
                                                         "rollout.n": 4})
    res = trainer(args, nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("reward_model/score_mean", "reward_model/score_std",
                                                 "reward_model/env_reward_mean"))
        assert m["reward_model/score_std"] > 0  # the samples differ, and so do their scores
        # every sample is scored (the parity env never fails): reward = env reward + score, on average too
        assert m["reward/mean"] == pytest.approx(m["reward_model/env_reward_mean"] + m["reward_model/score_mean"],
                                                 abs=1e-5)
        assert m["perf/reward_model_s"] > 0

    tok = AutoTokenizer.from_pretrained(reward_model)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()
    checked = 0
    for step in (1, 2):
        for line in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert rec["tokens_dropped"] == 0 and rec["prompt_chars_dropped"] == 0
            resp = rec["tokens"]["id"]
            if resp and resp[-1] == tok.eos_token_id:
                resp = resp[:-1]
            ids = tok(rec["prompt"], add_special_tokens=False)["input_ids"] + resp
            with torch.no_grad():
                score = hf(input_ids=torch.tensor([ids])).logits[0, 0].item()
            env_reward = rec["reward"] - score  # the parity env's reward: 0 or 1
            assert min(abs(env_reward), abs(env_reward - 1)) < 1e-4, (rec["reward"], score)
            checked += 1
    assert checked == 8
