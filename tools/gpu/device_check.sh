#!/usr/bin/env bash
# Every GPU check of tools/gpu in one bounded command, for a lent GPU machine that has torch
# but not Astra installed (the workplace's CUDA image: Python 3.12, torch, transformers).
#
#   bash tools/gpu/device_check.sh                  # every check; JSON and logs into $OUT
#   bash tools/gpu/device_check.sh run-hf-bf16      # only the named checks
#
# Checks: trainer-fp32 run-cuda trainer-bf16 engine-bench engines run-hf-bf16 (see README.md),
# and profile-trainer, run only when named.
# Installs nothing from a network. Astra's own pure-Python needs that the image lacks (grpcio at
# the stubs' version, protobuf, pydantic, zstandard, zlib-ng, ...) travel as wheels in
# .wheels-gpu/ (fetched on a machine with pip: tools/gpu/README.md); they go into /tmp/site,
# first on PYTHONPATH. astra.servers and astra.clients (top-level servers/ and clients/, mapped
# by setup.py) are linked into astra/ of this copy of the tree when the package is not
# installed. vLLM and SGLang are not in that image and are far over what can travel:
# run_engines.py skips an engine it cannot import and says so.
set -u
OUT=${OUT:-/tmp/astra-gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
CHECKS=${*:-trainer-fp32 run-cuda trainer-bf16 engine-bench engines run-hf-bf16}
if ls .wheels-gpu/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .wheels-gpu/*.whl || exit 3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# `astra run`'s children (python -m astra.cli) and the shaped reward, by dotted path
export PYTHONPATH=$PWD:$PWD/tools/gpu${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import astra.clients" 2>/dev/null; then
    [ -e astra/servers ] || ln -s ../servers astra/servers
    [ -e astra/clients ] || ln -s ../clients astra/clients
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'grpc', grpc.__version__, 'protobuf', p.__version__)"

declare -A RC
run() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    RC[$name]=$?
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    echo "=== $name: rc ${RC[$name]} in $((SECONDS - t0)) s"
}

summarize() {  # run dir, name: the run's summary into $OUT, key figures printed
    cp "$1/summary.json" "$OUT/$2-summary.json" 2>/dev/null
    grep -l "Traceback" "$1"/logs/* 2>/dev/null | sed 's/^/traceback in /'
    $PY - "$1/summary.json" <<'SUMMARY' 2>&1
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("status", "steps", "wall_seconds", "accuracy_first10", "accuracy_last10",
        "groups_trained", "groups_lost", "groups_duplicated", "restarts")
print({k: s.get(k) for k in keys})
ev = s.get("eval") or {}
print("eval by version:", [(r["version"], r["mean_reward"]) for r in ev.get("results", [])])
SUMMARY
}

write_m100() {
    $PY - /tmp/astra-m100 <<'EOF'
import sys
from pathlib import Path
sys.path[:0] = [".", "tools/bench"]
from engine import write_model  # the engine benchmark's ~100M Qwen3-architecture model
write_model("~100M", Path(sys.argv[1]))
EOF
}

for check in $CHECKS; do
    case $check in
    trainer-fp32)
        run trainer-fp32 120 $PY tools/gpu/run_trainer.py --out "$OUT/trainer-fp32.json" ;;
    run-cuda)  # the embedded default recipe, both RaaS and the trainer on cuda
        rm -rf /tmp/astra-run
        run run-cuda 200 $PY -m astra.cli run --run-dir /tmp/astra-run \
            --set raas.0.device=cuda --set raas.1.device=cuda --set trainer.device=cuda
        summarize /tmp/astra-run run-cuda ;;
    trainer-bf16)
        [ -d /tmp/astra-m100 ] || write_m100
        run trainer-bf16 120 $PY tools/gpu/run_trainer.py --model /tmp/astra-m100 \
            --dtype bfloat16 --steps 4 --groups 8 --max-new 64 --out "$OUT/trainer-bf16.json" ;;
    engine-bench)
        run engine-bench 150 $PY tools/bench/engine.py --device cuda --no-write --budget-s 90 ;;
    profile-trainer)  # where a bf16 step of the ~100M model goes (not in the default list)
        [ -d /tmp/astra-m100 ] || write_m100
        run profile-trainer 150 $PY tools/gpu/profile_trainer.py --model /tmp/astra-m100 \
            --dtype bfloat16 --groups 8 --max-new 64 ;;
    engines)
        run engines 60 $PY tools/gpu/run_engines.py --out "$OUT/engines.json" ;;
    run-hf-bf16)  # gpu_hf.yaml with the built-in engine: a HF directory with a tokenizer
        # (random 4-layer Qwen3, byte-level BPE), bf16 trainer and engine on cuda, bf16
        # deltas; the dense shaped reward gives a random model something to learn.
        rm -rf /tmp/astra-rand /tmp/astra-hf
        $PY -c "import sys; from pathlib import Path; sys.path.insert(0, 'tools/gpu'); \
from run_engines import make_random_model; make_random_model(Path('/tmp/astra-rand'))"
        run run-hf-bf16 200 $PY -m astra.cli run configs/recipes/gpu_hf.yaml \
            --run-dir /tmp/astra-hf --set policies.0.model=/tmp/astra-rand \
            --set raas.0.name=torch-0 --set raas.0.engine=torch --set "raas.0.engine_args=''" \
            --set streams.0.reward=shaped_reward:digit_share \
            --set "streams.0.sampling.stop_strings=[]" --set streams.0.sampling.max_new_tokens=64 \
            --set policies.0.buffer.drop_equal_rewards=false --set trainer.num_steps=40 \
            --set trainer.checkpoint.every_steps=20 --set eval.every_steps=20
        summarize /tmp/astra-hf run-hf-bf16 ;;
    *) echo "unknown check $check"; RC[$check]=2 ;;
    esac
done

echo
echo "| check | rc |"
echo "|---|---:|"
failed=0
for name in $CHECKS; do
    echo "| $name | ${RC[$name]:-not run} |"
    [ "${RC[$name]:-0}" = 0 ] || failed=1
done
exit $failed  # (engines exits 1 where neither vLLM nor SGLang can be imported)
