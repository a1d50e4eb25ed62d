#!/usr/bin/env bash
# `make trl`: Hugging Face TRL in an environment of its own, for tools/bench/vs_trl.py (the
# time-to-accuracy comparison with TRL's GRPOTrainer). Astra's .venv never holds trl: TRL pulls
# its own transformers/accelerate/datasets pins. torch==2.13.0 (the CPU build this project
# installs) is installed first so pip takes it from this disk and pulls nothing CUDA; then
# trl==$TRL_VERSION, which brings transformers, accelerate and datasets.
# Ends by importing trl and printing its version, or exits 1 saying which step failed.
set -euo pipefail
VENV=${1:-.venv-trl}
TRL_VERSION=${TRL_VERSION:-1.16.0}
PYTHON=${PYTHON:-python3}

step() { echo "trl env: $*" >&2; }
fail() { echo "trl env: FAILED: $*" >&2; exit 1; }

rm -f "$VENV/.installed"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip || fail "upgrading pip in $VENV"

step "installing torch==2.13.0 (CPU) and trl==$TRL_VERSION"
"${PIP[@]}" torch==2.13.0 || fail "pip install torch==2.13.0"
"${PIP[@]}" "trl==$TRL_VERSION" || fail "pip install trl==$TRL_VERSION"

VERSION=$("$VENV/bin/python" -c 'import trl, transformers, torch; print("trl", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__)' 2>&1 | tail -1) \
  || fail "trl does not import in $VENV: $VERSION"
step "ready: $VENV/bin/python ($VERSION)"
touch "$VENV/.installed"
