#!/usr/bin/env bash
# The checks that need a CUDA device, in one command (docs/gpu.md records what they gave):
#
#   bash scripts/gpu_check.sh [MODEL] [OUT]      # MODEL: a checkpoint folder (default smollm2-135m-instruct)
#   STAGES="tests train" bash scripts/gpu_check.sh ...   # a subset of: tests train throughput kv
#
# tests:      tests/gpu (the native engine on CUDA against transformers and against the CPU engine, the draw under
#             CUDA's sync detector, w8a8/fp8 rollouts, memory returned on sleep, the trainer on CUDA with NCCL)
# train:      3 GRPO steps of MODEL on one GPU (torchrun, FSDP2, NCCL, bf16), dense and +preset=sparse_rl, 16 prompts
#             x 8 samples x 512 new tokens; prints the step times and the mismatch metrics
# throughput: benchmarks/rollout_throughput.py on CUDA in bf16 (native engine vs transformers generate, with the
#             GEMM floor), batch 8 / 64 / 256
# kv:         benchmarks/kv_compression.py on CUDA in bf16: dense vs R-KV in one fixed KV pool
#
# Every stage writes its log to OUT (default outputs/gpu_check) and has its own time limit, so one slow stage
# does not hide the others; the summary at the end says which passed.
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-135m-instruct}
out=${2:-outputs/gpu_check}
stages=${STAGES:-tests train throughput kv}
PY=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SPARSERL_PROGRESS=0
declare -A status

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

train() {
  local rc=0
  for preset in dense sparse_rl; do
    $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m sparserl.trainer.grpo +preset=$preset \
      model.path="$model" trainer.total_steps=3 trainer.prompts_per_step=16 rollout.n=8 rollout.max_new_tokens=512 \
      rollout.kv.budget=128 algo.correction.enable=true trainer.output_dir="$out/run_$preset" trainer.log_samples=0 \
      || rc=$?
    $PY - "$out/run_$preset/metrics.jsonl" <<'PYEOF' || rc=$?
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    keys = ["step", "perf/step_s", "perf/rollout_s", "perf/update_s", "perf/weight_sync_s", "perf/rollout_tok_s", "mismatch/kl", "mismatch/abs_max",
            "kv/retained_frac", "correction/rejected_seq_frac", "mem/peak_gb"]
    print("  ".join(f"{k}={m[k]:.4g}" if isinstance(m.get(k), float) else f"{k}={m.get(k)}" for k in keys))
PYEOF
  done
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "| device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'

stage tests 420 $PY -m pytest tests/gpu -q -p no:cacheprovider -rs
export -f train
export model out PY
stage train 420 bash -c train
stage throughput 200 $PY benchmarks/rollout_throughput.py --device cuda --model "$model" --dtype bfloat16 --batch 8 64 256 \
  --new-tokens 256 --repeats 2
stage kv 240 $PY benchmarks/kv_compression.py --device cuda --model "$model" --dtype bfloat16 --requests 32 --new-tokens 1024 \
  --policies rkv --budgets 128 256 --divide-length 128 --dense-slots-for 8 --overhead-requests 0

echo "=== summary"
for name in $stages; do echo "$name: ${status[$name]:-not run}"; done
