#!/usr/bin/env bash
# The checks that need a CUDA device, in one command of at most 8 minutes (docs/gpu.md records what they gave):
#
#   bash scripts/gpu_check.sh [OUT]             # on the GPU machine; OUT defaults to outputs/gpu_check
#   DRY_RUN=1 bash scripts/gpu_check.sh         # on a CPU: the same stages on tiny shapes, in about a minute
#   STAGES="tests decode" bash scripts/gpu_check.sh   # a subset of: tests decode train
#
# tests:  tests/gpu (the native engine on CUDA against transformers and the CPU engine, the captured decode step
#         against the eager one and under CUDA's sync detector, the Triton decode kernel, the single-call training
#         attention and the ring kernel against their references, quantized rollouts, sleep, the trainer on NCCL)
# decode: benchmarks/gpu_decode.py: a Qwen2.5-1.5B-shaped model with random weights built on the device from a config
#         in the script; per decode step ms, launches and syncs at batch 64 and 256, eager vs captured vs transformers'
#         generate vs the step's floor, R-KV budget 512 at 2048 new tokens against dense at a fixed pool, weight sync
# train:  benchmarks/train_step.py --device cuda: forward+backward of an 8k-token micro-batch of the same shape, MFU
#         against a GEMM peak measured in the run, shared prompts and recompute on/off, a 16k response under a 512
#         prompt, the ring block kernel against one fused call
#
# Nothing is downloaded and nothing large is carried in: every model is built from a config. Each stage has its own
# time limit (together 460 s) and log, so one slow stage does not hide the others; the summary says which passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/gpu_check}
stages=${STAGES:-tests decode train}
PY=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SPARSERL_PROGRESS=0
declare -A status
if [ "${DRY_RUN:-0}" = 1 ]; then
  device=(--device cpu --dtype float32 --dry-run)
else
  device=(--device cuda)
fi

stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  [[ " $stages " == *" $name "* ]] || return 0
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  status[$name]="exit $rc, $((SECONDS - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "| device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
$PY -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"

stage tests 130 $PY -m pytest tests/gpu -q -p no:cacheprovider -rs --durations=10
stage decode 190 $PY benchmarks/gpu_decode.py "${device[@]}"
stage train 140 $PY benchmarks/train_step.py "${device[@]}"

echo "=== summary"
for name in $stages; do echo "$name: ${status[$name]:-not run}"; done
