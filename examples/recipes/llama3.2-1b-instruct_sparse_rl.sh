#!/usr/bin/env bash
# Llama-3.2-1B-Instruct, R-KV rollouts + Sparse-RL correction (the paper's recipe; see paper.sh). 4 GPUs.
#   MODEL_PATH=/ckpt/Llama-3.2-1B-Instruct bash examples/recipes/llama3.2-1b-instruct_sparse_rl.sh [overrides...]
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the Llama-3.2-1B-Instruct checkpoint folder}"
DATA=simplelr_level3to5 MODE=sparse_rl exec bash "$(dirname "$0")/paper.sh" "$@"
