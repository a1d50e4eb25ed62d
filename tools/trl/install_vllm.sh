#!/usr/bin/env bash
# `make trl-vllm`: TRL beside vLLM, for the "TRL + vLLM" side of tools/bench/vs_trl.py (GRPOTrainer
# with use_vllm=True, vllm_mode="colocate"). TRL must import in the same interpreter as vLLM, and
# vLLM's environment (.venv-vllm, `make vllm`) stays as it is: this environment reads
# .venv-vllm's packages through a .pth file (vLLM, its torch and transformers) and adds only what
# TRL needs on top (trl==$TRL_VERSION, accelerate, datasets). Rebuild it after `make vllm`.
# Ends by importing trl and vllm and printing their versions, or exits 1 saying which step failed.
set -euo pipefail
VENV=${1:-.venv-trl-vllm}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
TRL_VERSION=${TRL_VERSION:-1.16.0}
PYTHON=${PYTHON:-python3}

step() { echo "trl+vllm env: $*" >&2; }
fail() { echo "trl+vllm env: FAILED: $*" >&2; exit 1; }

SITE=$(cd "$VLLM_VENV" 2>/dev/null && "./bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
  || fail "no vLLM environment at $VLLM_VENV (run \`make vllm\` first)"
rm -f "$VENV/.installed"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV"
OWN=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$SITE" > "$OWN/zz_vllm_env.pth"  # after this environment's own packages
step "installing trl==$TRL_VERSION over $SITE"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "trl==$TRL_VERSION" \
  || fail "pip install trl==$TRL_VERSION"
VERSION=$("$VENV/bin/python" -c 'import trl, vllm, transformers; print("trl", trl.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1) \
  || fail "trl and vllm do not import together in $VENV: $VERSION"
step "ready: $VENV/bin/python ($VERSION)"
touch "$VENV/.installed"
