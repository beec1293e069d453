#!/usr/bin/env bash
# Llama-3.2-1B-Instruct, dense rollouts (the paper's recipe; see paper.sh). 4 GPUs.
#   MODEL_PATH=/ckpt/Llama-3.2-1B-Instruct bash examples/recipes/llama3.2-1b-instruct_dense.sh [overrides...]
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the Llama-3.2-1B-Instruct checkpoint folder}"
DATA=simplelr_level3to5 MODE=dense exec bash "$(dirname "$0")/paper.sh" "$@"
