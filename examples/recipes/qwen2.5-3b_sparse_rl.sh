#!/usr/bin/env bash
# Qwen2.5-3B, R-KV rollouts + Sparse-RL correction (the paper's recipe; see paper.sh). 4 GPUs by default.
#   MODEL_PATH=/ckpt/Qwen2.5-3B bash examples/recipes/qwen2.5-3b_sparse_rl.sh [overrides...]
#   GPUS=8 sets the GPU count (torchrun --nproc_per_node; 128 prompts per step must divide by GPUS / parallel.tp).
#   Memory per GPU, estimated: ~31 GB on 4 GPUs, ~24 GB on 8, plus a few GB (rollout.kv_pool_tokens
#   lowers it; docs/training.md#on-gpus-which-engine-how-many-gpus-how-much-memory). Native engine.
#   Rerunning into the same RUN folder: add trainer.resume=auto (continue) or trainer.overwrite=true.
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the Qwen2.5-3B checkpoint folder}"
DATA=simplelr_qwen_level3to5 MODE=sparse_rl exec bash "$(dirname "$0")/paper.sh" "$@"
