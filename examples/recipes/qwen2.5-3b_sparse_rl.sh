#!/usr/bin/env bash
# Qwen2.5-3B, R-KV rollouts + Sparse-RL correction (the paper's recipe; see paper.sh). 4 GPUs.
#   MODEL_PATH=/ckpt/Qwen2.5-3B bash examples/recipes/qwen2.5-3b_sparse_rl.sh [overrides...]
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the Qwen2.5-3B checkpoint folder}"
DATA=simplelr_qwen_level3to5 MODE=sparse_rl exec bash "$(dirname "$0")/paper.sh" "$@"
