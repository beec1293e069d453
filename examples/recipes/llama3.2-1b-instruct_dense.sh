#!/usr/bin/env bash
# Llama-3.2-1B-Instruct, dense rollouts (the paper's recipe; see paper.sh). 4 GPUs by default.
#   MODEL_PATH=/ckpt/Llama-3.2-1B-Instruct bash examples/recipes/llama3.2-1b-instruct_dense.sh [overrides...]
#   GPUS=8 sets the GPU count (torchrun --nproc_per_node; 128 prompts per step must divide by GPUS / parallel.tp).
#   Memory per GPU, estimated: ~17 GB on 4 GPUs, ~14 GB on 8, plus a few GB (rollout.kv_pool_tokens
#   lowers it; docs/training.md#on-gpus-which-engine-how-many-gpus-how-much-memory). Native engine.
#   Rerunning into the same RUN folder: add trainer.resume=auto (continue) or trainer.overwrite=true.
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the Llama-3.2-1B-Instruct checkpoint folder}"
DATA=simplelr_level3to5 MODE=dense exec bash "$(dirname "$0")/paper.sh" "$@"
