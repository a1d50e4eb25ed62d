#!/usr/bin/env bash
# Every GPU check of tools/gpu in one bounded command, for a lent GPU machine that has torch
# but not Astra installed (the workplace's CUDA image: Python 3.12, torch, transformers).
#
#   bash tools/gpu/device_check.sh            # writes JSON and logs into $OUT (default /tmp)
#
# Installs nothing from a network. Astra's own pure-Python needs that the image lacks (grpcio at
# the stubs' version, protobuf, pydantic, zstandard, zlib-ng, ...) travel as wheels in .wheels-gpu/
# (fetched on a machine with pip: tools/gpu/README.md); they go into /tmp/site, first on
# PYTHONPATH. astra.servers and astra.clients (top-level servers/ and clients/, mapped by
# setup.py) are linked into astra/ of this copy of the tree when the package is not installed.
# vLLM and SGLang are not in that image and are far over what can travel: run_engines.py skips
# an engine it cannot import and says so.
set -u
OUT=${OUT:-/tmp/astra-gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
if ls .wheels-gpu/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .wheels-gpu/*.whl || exit 3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # `astra run`'s children: python -m astra.cli
if ! $PY -c "import astra.clients" 2>/dev/null; then
    [ -e astra/servers ] || ln -s ../servers astra/servers
    [ -e astra/clients ] || ln -s ../clients astra/clients
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'grpc', grpc.__version__, 'protobuf', p.__version__)"

M100=/tmp/astra-m100
$PY - "$M100" <<'EOF'
import sys
from pathlib import Path
sys.path[:0] = [".", "tools/bench"]
from engine import write_model  # the engine benchmark's ~100M Qwen3-architecture model
write_model("~100M", Path(sys.argv[1]))
print("wrote", sys.argv[1])
EOF

declare -A RC
run() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    RC[$name]=$?
    tail -n 40 "$OUT/$name.log"
    echo "=== $name: rc ${RC[$name]} in $((SECONDS - t0)) s"
}

run trainer-fp32 120 $PY tools/gpu/run_trainer.py --out "$OUT/trainer-fp32.json"
# The whole system on the GPU: the embedded default recipe, both RaaS and the trainer on cuda.
rm -rf /tmp/astra-run
run run-cuda 200 $PY -m astra.cli run --run-dir /tmp/astra-run --set raas.0.device=cuda \
    --set raas.1.device=cuda --set trainer.device=cuda
cp /tmp/astra-run/summary.json "$OUT/run-cuda-summary.json" 2>/dev/null
$PY - /tmp/astra-run/summary.json <<'SUMMARY' 2>&1
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("status", "steps", "wall_seconds", "accuracy_first10", "accuracy_last10",
        "groups_trained", "groups_lost", "groups_duplicated", "restarts", "eval")
print({k: s.get(k) for k in keys})
SUMMARY
grep -l -E "Traceback|ERROR" /tmp/astra-run/logs/* 2>/dev/null | head -5
run trainer-bf16 120 $PY tools/gpu/run_trainer.py --model "$M100" --dtype bfloat16 --steps 4 \
    --groups 8 --max-new 64 --out "$OUT/trainer-bf16.json"
run engine-bench 150 $PY tools/bench/engine.py --device cuda --no-write --budget-s 90
run engines 60 $PY tools/gpu/run_engines.py --out "$OUT/engines.json"

echo
echo "| check | rc |"
echo "|---|---:|"
for name in trainer-fp32 run-cuda trainer-bf16 engine-bench engines; do
    echo "| $name | ${RC[$name]:-not run} |"
done
