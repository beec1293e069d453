#!/usr/bin/env bash
# Qwen2.5-3B, dense rollouts (the paper's recipe; see paper.sh). 4 GPUs.
#   MODEL_PATH=/ckpt/Qwen2.5-3B bash examples/recipes/qwen2.5-3b_dense.sh [overrides...]
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the Qwen2.5-3B checkpoint folder}"
DATA=simplelr_qwen_level3to5 MODE=dense exec bash "$(dirname "$0")/paper.sh" "$@"
