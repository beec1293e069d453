"""The train_step.py workload run by Hugging Face TRL's GRPOTrainer, for a side-by-side comparison.

    python benchmarks/trl_workload.py OUT.json --steps 3 [--model smollm2-135m-instruct]

TRL is not a dependency of this project: install it yourself (`pip install --no-deps trl`) to run this.
Same data (MAWPS), prompt (system prompt + question in the chat template), reward (the project's math-verify
check of the last \\boxed{} answer), 16 prompts x 4 samples per optimizer step, one optimizer step per rollout
(so TRL computes no separate old log-probs), 128 new tokens at temperature 1, Dr.GRPO loss (no std scaling),
lr 1e-6, no KL, fp32, TRL's defaults otherwise (gradient checkpointing on). Writes per-step wall time, the
generation time inside it (TRL's `_generate_and_score_completions`, timed by wrapping it), and the process's
peak RSS after each step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import EVAL_DATA  # noqa: E402
from sparserl.utils.memory import peak_rss_gb  # noqa: E402

SYSTEM = "Solve the problem and put your final answer within \\boxed{}."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sparserl.actor.hf import load_model, load_tokenizer, resolve_model_path
    from sparserl.rewards.math import verify_answer

    path = resolve_model_path(args.model)
    rows = [json.loads(line) for line in open(EVAL_DATA / "mawps.jsonl")]
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["input"]}],
                               "answer": str(r["target"])} for r in rows])

    def math_reward(completions, answer, **_):
        return [1.0 if verify_answer(c[0]["content"], a) else 0.0 for c, a in zip(completions, answer)]

    gen_s: list[float] = []
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.g0 = time.perf_counter(), sum(gen_s)

        def on_step_end(self, *a, **k):
            steps.append({"step_s": time.perf_counter() - self.t0, "rollout_s": sum(gen_s) - self.g0, "peak_gb": peak_rss_gb()})
            print(f"trl step {len(steps)}: {steps[-1]}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=4,
                         max_completion_length=128, temperature=1.0, learning_rate=1e-6, loss_type="dr_grpo",
                         scale_rewards="none", beta=0.0, max_steps=args.steps, logging_steps=1, use_cpu=True, bf16=False,
                         report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=load_model(path, "float32"), reward_funcs=math_reward, args=cfg, train_dataset=data,
                              processing_class=load_tokenizer(path), callbacks=[Clock()])
        inner = trainer._generate_and_score_completions

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                gen_s.append(time.perf_counter() - t0)

        trainer._generate_and_score_completions = timed
        trainer.train()
    Path(args.out).write_text(json.dumps({"steps": steps, "threads": os.environ.get("OMP_NUM_THREADS")}))


if __name__ == "__main__":
    main()
