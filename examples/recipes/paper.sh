#!/usr/bin/env bash
# The Sparse-RL paper's GPU recipe on one node of 4 GPUs: configs/gpu.yaml (128 prompts x 8 samples per step, 4096
# new tokens, temperature 1.0, lr 1e-6 (Adam 0.9/0.98, wd 0.1), KL 1e-4 (k3, in the loss), clip 0.2, per-sequence
# loss mean, 4 optimizer steps per rollout, 100 steps; R-KV budget 512 / divide_length 128 / window 8 / lambda 0.1)
# with a preset for the rollout mode, a model and a training set.
#
#   MODEL_PATH=/ckpt/Qwen2.5-1.5B DATA=simplelr_qwen_level3to5 MODE=sparse_rl bash examples/recipes/paper.sh
#
# MODE: dense | naive_sparse | sparse_rl (configs/preset/). Extra arguments are passed on as overrides.
# GPUS (default 4): the GPU count, torchrun's --nproc_per_node; trainer.prompts_per_step=128 must divide by
#   GPUS / (parallel.tp x parallel.cp). RUN (default outputs/<model>-<mode>): the run folder; a rerun into one that
#   holds a run needs trainer.resume=auto (continue) or trainer.overwrite=true (start over).
# Engine: the native one (rollout.engine=native, the default); memory per GPU for each model and GPU count,
#   and when parallel.tp helps: docs/training.md#on-gpus-which-engine-how-many-gpus-how-much-memory
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to a Hugging Face checkpoint folder}"
DATA=${DATA:-simplelr_qwen_level3to5}
MODE=${MODE:-sparse_rl}
GPUS=${GPUS:-4}
DATA_DIR=${DATA_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/data/train}
RUN=${RUN:-outputs/$(basename "$MODEL_PATH")-$MODE}

exec torchrun --standalone --nproc_per_node="$GPUS" -m sparserl.trainer.grpo --config-name gpu +preset="$MODE" \
  model.path="$MODEL_PATH" data.train_path="$DATA_DIR/$DATA.jsonl" trainer.output_dir="$RUN" \
  "$@"
