#!/usr/bin/env bash
# The checks that need a CUDA device, in one command of at most 7.5 minutes (docs/gpu.md, "The next check", says
# what each stage measures; the tables it gave go there with the machine):
#
#   bash scripts/gpu_check.sh [OUT]             # on the GPU machine; OUT defaults to outputs/gpu_check
#   DRY_RUN=1 bash scripts/gpu_check.sh         # on a CPU: the same stages on tiny shapes, in under 2 minutes
#   STAGES="probe tests" bash scripts/gpu_check.sh   # a subset of: probe tests decode train
#
# probe:  scripts/gpu_probe.py: the machine (torch, triton, CUDA, device, free memory, gcc and Python.h) and one
#         launch of each Triton kernel at the decode shape of the model below, registers and spills as loaded
# tests:  the new paths first, in this order: the Triton decode kernel compiled (tests/unit/test_paged_decode_kernel.py,
#         at the engine's shapes too), the captured decode step, the update's kernels, the single-call training
#         attention; then the rest of tests/gpu (the engine on CUDA, quantized rollouts, sleep, the trainer on NCCL)
# decode: benchmarks/gpu_decode.py: a Qwen2.5-1.5B-shaped model with random weights built on the device from a config;
#         per decode step ms, launches, syncs and event waits at batch 64 and 256, eager vs captured vs transformers'
#         generate vs the step's floor, R-KV budget 512 against dense at a fixed pool, the weight push
# train:  benchmarks/train_step.py --device cuda: forward+backward of an 8k-token micro-batch of the same shape, MFU
#         against a GEMM peak measured in the run, shared prompts and recompute on/off, a 16k response under a 512
#         prompt, the ring block kernel against one fused call
#
# Nothing is downloaded and nothing large is carried in: every model is built from a config. The stages run in this
# order, each under its own limit (SIGINT 10 s before it, so pytest and the benchmarks print what they have, SIGKILL
# at it), each with its own log; a stage that fails or runs out of time leaves the others running. Every stage prints
# its rows as they are measured. The summary says how each ended; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/gpu_check}
stages=${STAGES:-probe tests decode train kv_memory}
PY=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SPARSERL_PROGRESS=0
declare -A status
if [ "${DRY_RUN:-0}" = 1 ]; then
  device=(--device cpu --dtype float32 --dry-run)
  probe=(--dry-run)
  kvmem=(--gpu --device cpu --shape tiny --prompts 2 --n 2 --max-new-tokens 8 --bitwise-prompts 1)
  # On a CPU the kernel runs under triton's interpreter (seconds a case): the engine-shape cases only; tests/gpu skips.
  kernel_tests=(tests/unit/test_paged_decode_kernel.py::test_engine_shape_qwen25_1p5b)
else
  device=(--device cuda)
  probe=()
  kvmem=(--gpu --prompts 8 --max-new-tokens 256 --bitwise-prompts 2)  # 8 x 8 sequences at the Qwen2.5-1.5B shape, rows as measured
  kernel_tests=(tests/unit/test_paged_decode_kernel.py)
fi

# The limits, in seconds, with the 10 s for SIGKILL inside each; together at most 450 s (7.5 minutes).
LIMIT_PROBE=${LIMIT_PROBE:-30} LIMIT_TESTS=${LIMIT_TESTS:-150} LIMIT_DECODE=${LIMIT_DECODE:-120}
LIMIT_TRAIN=${LIMIT_TRAIN:-90}
LIMIT_KVMEM=${LIMIT_KVMEM:-60}

stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  [[ " $stages " == *" $name "* ]] || return 0
  echo "=== $name (limit $limit s): $*"
  local t0=$SECONDS
  timeout -s INT -k 10 $((limit - 10)) "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  local why=""
  [ "$rc" = 124 ] && why=" (time limit: SIGINT at $((limit - 10)) s)"
  [ "$rc" = 137 ] && why=" (killed at $limit s)"
  status[$name]="exit $rc$why, $((SECONDS - t0)) s"
}

echo "=== gpu_check: stages '$stages', limits probe $LIMIT_PROBE + tests $LIMIT_TESTS + decode $LIMIT_DECODE + train" \
     "$LIMIT_TRAIN + kv_memory $LIMIT_KVMEM = $((LIMIT_PROBE + LIMIT_TESTS + LIMIT_DECODE + LIMIT_TRAIN + LIMIT_KVMEM)) s"

stage probe "$LIMIT_PROBE" $PY scripts/gpu_probe.py "${probe[@]}"
stage tests "$LIMIT_TESTS" $PY -m pytest -p no:cacheprovider --order-seed=off -v -rfEs --durations=15 \
  "${kernel_tests[@]}" tests/gpu/test_decode_graphs.py tests/gpu/test_update_cuda.py tests/gpu/test_packed_cuda.py \
  tests/gpu/test_cuda.py
stage decode "$LIMIT_DECODE" $PY benchmarks/gpu_decode.py "${device[@]}" --kv-new-tokens 1024
stage train "$LIMIT_TRAIN" $PY benchmarks/train_step.py "${device[@]}"

# The rollout half of benchmarks/fixed_memory.py at a fixed KV memory (8 dense sequences' bytes) at the Qwen2.5-1.5B
# shape, random weights, captured decode on: dense reservation / optimistic, R-KV tail, int8 KV, R-KV + int8 KV.
stage kv_memory "$LIMIT_KVMEM" $PY benchmarks/fixed_memory.py "${kvmem[@]}"

echo "=== summary"
failed=0
for name in $stages; do
  echo "$name: ${status[$name]:-not run}"
  [[ "${status[$name]:-exit 0}" == "exit 0,"* ]] || failed=1
done
exit $failed
