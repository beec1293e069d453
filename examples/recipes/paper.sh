#!/usr/bin/env bash
# The Sparse-RL paper's GPU recipe on one node of 4 GPUs: 128 prompts x 8 samples per step, 4096 new tokens,
# temperature 1.0, lr 1e-6 (Adam 0.9/0.98, wd 0.1), KL 1e-4 (k3, in the loss), clip 0.2, per-sequence loss mean,
# 4 optimizer steps per rollout, 100 steps; R-KV budget 512 / divide_length 128 / window 8 / lambda 0.1.
#
#   MODEL_PATH=/ckpt/Qwen2.5-1.5B DATA=simplelr_qwen_level3to5 MODE=sparse_rl bash examples/recipes/paper.sh
#
# MODE: dense | naive_sparse | sparse_rl (configs/preset/). Extra arguments are passed on as overrides.
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to a Hugging Face checkpoint folder}"
DATA=${DATA:-simplelr_qwen_level3to5}
MODE=${MODE:-sparse_rl}
GPUS=${GPUS:-4}
DATA_DIR=${DATA_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/data/train}
RUN=${RUN:-outputs/$(basename "$MODEL_PATH")-$MODE}

exec torchrun --standalone --nproc_per_node="$GPUS" -m sparserl.trainer.grpo \
  +preset="$MODE" \
  model.path="$MODEL_PATH" model.dtype=float32 model.compute_dtype=bfloat16 \
  data.train_path="$DATA_DIR/$DATA.jsonl" data.prompt_key=prompt data.answer_key=label data.max_prompt_tokens=1024 \
  env.path=envs/math.py \
  rollout.n=8 rollout.max_new_tokens=4096 rollout.temperature=1.0 rollout.top_p=1.0 rollout.dtype=bfloat16 \
  rollout.kv_pool_tokens=262144 \
  actor.lr=1e-6 actor.betas='[0.9,0.98]' actor.weight_decay=0.1 actor.max_grad_norm=1.0 \
  actor.max_tokens_per_device=8192 actor.updates_per_rollout=4 \
  algo.adv_estimator=grpo algo.loss_agg=sequence algo.clip_low=0.2 algo.clip_high=0.2 \
  algo.kl.coef=1e-4 algo.kl.estimator=k3 algo.kl.mode=loss \
  trainer.prompts_per_step=128 trainer.total_steps=100 trainer.save_every=20 trainer.output_dir="$RUN" \
  "$@"
