#!/usr/bin/env bash
# The GPU work of the benchmark, on a GPU machine without network access, as parts of under 10 minutes each (for
# machines that limit how long one command runs); see benchmarks/README.md for bringing the packages the machine
# lacks as wheels (.whl/) and for carrying the results from one part to the next.
#
#   bash benchmarks/gpu_session.sh 1   the smoke checks (tests/test_device.py) and the end-to-end runs (ViT-B/16, S/16)
#   bash benchmarks/gpu_session.sh smoke   part 1's smoke checks alone (for a short device budget)
#   bash benchmarks/gpu_session.sh 2   eager rows of ViT-S/16, B/16 and L/16, then compiled rows of ViT-S/16
#   bash benchmarks/gpu_session.sh 3   compiled rows of ViT-B/16 (with a profile of its training step)
#   bash benchmarks/gpu_session.sh 4   compiled rows of ViT-L/16
#   bash benchmarks/gpu_session.sh packing   the packing rows (gpu.py --packing_only): square, padded with a mask, padded
#                                            through variable-length attention, packed; eager and compiled
#   bash benchmarks/gpu_session.sh quick   parts 1 and 2's code paths (and the packing rows) on tiny models, in about a
#                                          minute (CPU or GPU)
#
# Each part writes under $OUT (default outputs/gpu). Parts 2-4 merge into docs/benchmarks_gpu.json: copy the file
# that comes back from one part into docs/ before the next. Each step has its own `timeout`, and gpu.py its time
# budget, so that a part ends inside its 10 minutes with what it measured.
set -uo pipefail
part=${1:?usage: bash benchmarks/gpu_session.sh 1|2|3|4|packing|smoke|quick}
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
# Packages the machine lacks, brought as wheels, go to a folder whose path holds "site-packages": dill (which datasets
# uses to fingerprint what it caches) pickles a module found anywhere else by value, and fails on pyarrow's.
SITE=${SITE:-/tmp/hf-vit/site-packages}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || exit 1
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    # What they require and the machine lacks or has too old: from .whl/fallback/ (a large wheel such as pyarrow
    # travels there, to replace the machine's own only where that is too old); what is still unmet is printed.
    fallback=$("$PY" benchmarks/wheel_requirements.py .whl --fallback .whl/fallback 2>"$OUT/unmet_requirements.txt")
    if [ -n "$fallback" ]; then
        echo "== from .whl/fallback: $fallback"
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            $fallback || exit 1
    fi
    "$PY" benchmarks/wheel_requirements.py .whl 2>&1 >/dev/null | tee "$OUT/unmet_requirements.txt"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
JSON=docs/benchmarks_gpu.json
# e.g. COMPILE_FLAGS=--compile_blocks (each block compiled once, fullgraph: minutes less per model) or
# COMPILE_FLAGS="--compile_mode max-autotune"; applies to the compiled rows of parts 2-4.
read -r -a COMPILE <<<"${COMPILE_FLAGS:-}"
status=0
step() {  # step SECONDS NAME COMMAND...: run with a time limit, log to $OUT/NAME.log, remember a failure
    local seconds=$1 name=$2
    shift 2
    echo "== $name (at most ${seconds} s)"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name: exit status $rc"; status=1; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$OUT/nvidia-smi.csv" 2>&1 || true
"$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|datasets|accelerate|huggingface.hub|timm|torchvision|pyarrow|fsspec|tokenizers|onnx|onnxruntime|onnxscript|dill|multiprocess|evaluate|numpy|pandas|peft|xxhash|safetensors) " \
    | tee "$OUT/packages.txt"
# What the programs will import (pip list above also shows the machine's own copies that $SITE shadows).
"$PY" -c "import datasets, evaluate, fsspec, pyarrow, torch, transformers, huggingface_hub as h
print('imported:', *(f'{m.__name__} {m.__version__}' for m in (torch, transformers, h, datasets, evaluate, pyarrow, fsspec)))
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1 \
    | tee -a "$OUT/packages.txt"

# The smoke checks: tests/test_device.py on the GPU (on CPU where torch sees none), each test's result line in
# smoke.log and in smoke.xml's junit properties. SMOKE_ONLY="check ..." runs some of them (pytest -k: a rerun of those
# that failed); SMOKE_KEEP=/tmp/smoke keeps their scratch folder (the training runs' logs): pytest's --basetemp, which
# empties the folder first, so it must be new, empty, or marked by an earlier run as the checks' own.
device=cpu
grep -q "^cuda True" "$OUT/packages.txt" && device=cuda
smoke=(-m pytest -p no:cacheprovider -q -s -rA tests/test_device.py --device "$device" --junitxml "$OUT/smoke.xml"
    -o junit_family=xunit1 -o log_level=WARNING)  # xunit1: the junit file keeps the properties; no debug logs
[ -z "${SMOKE_ONLY:-}" ] || smoke+=(-k "${SMOKE_ONLY// / or }")
KEPT=.hf-vit-smoke  # written in $SMOKE_KEEP after each run: the folder is the smoke checks' scratch
if [ -n "${SMOKE_KEEP:-}" ]; then
    if [ -n "$(ls -A "$SMOKE_KEEP" 2>/dev/null)" ] && [ ! -f "$SMOKE_KEEP/$KEPT" ]; then
        echo "SMOKE_KEEP=$SMOKE_KEEP holds files the smoke checks did not write, which pytest --basetemp would" \
            "delete: name a new or empty folder" >&2
        exit 2
    fi
    smoke+=(--basetemp "$SMOKE_KEEP")
fi
smoke_step() {  # smoke_step SECONDS: the smoke checks, their kept scratch folder marked as theirs
    step "$1" smoke "$PY" "${smoke[@]}"
    [ -z "${SMOKE_KEEP:-}" ] || [ ! -d "$SMOKE_KEEP" ] || : >"$SMOKE_KEEP/$KEPT"
}

case "$part" in
smoke)
    smoke_step 330
    ;;
1)
    # About 280 s on an H100 by estimate (not yet measured): 330 s leaves room.
    smoke_step 330
    step 145 end_to_end_b16 "$PY" benchmarks/end_to_end.py --folder /tmp/hf-vit-jpegs --images 768 \
        --preset vit-base-patch16-224 --batch_size 256 --steps 8 --warmup_steps 3 --json "$OUT/end_to_end_b16.json" \
        -- --bf16
    step 120 end_to_end_s16 "$PY" benchmarks/end_to_end.py --folder /tmp/hf-vit-jpegs --images 768 \
        --preset vit-small-patch16-224 --batch_size 256 --steps 8 --warmup_steps 3 --json "$OUT/end_to_end_s16.json" \
        -- --bf16
    ;;
2)
    step 250 gpu_eager "$PY" benchmarks/gpu.py --no_compile --json "$OUT/benchmarks_gpu.json" --time_budget_s 200
    step 300 gpu_compiled_s16 "$PY" benchmarks/gpu.py --no_eager --models vit-small-patch16-224 --merge_json "${COMPILE[@]}" \
        --json "$OUT/benchmarks_gpu.json"
    ;;
3)
    cp "$JSON" "$OUT/benchmarks_gpu.json" || exit 1
    step 560 gpu_compiled_b16 "$PY" benchmarks/gpu.py --no_eager --models vit-base-patch16-224 --profile --merge_json "${COMPILE[@]}" \
        --json "$OUT/benchmarks_gpu.json"
    ;;
4)
    cp "$JSON" "$OUT/benchmarks_gpu.json" || exit 1
    step 560 gpu_compiled_l16 "$PY" benchmarks/gpu.py --no_eager --models vit-large-patch16-224 --merge_json "${COMPILE[@]}" \
        --json "$OUT/benchmarks_gpu.json"
    ;;
packing)
    # ViT-B width, 12 blocks, batch 128, K = 256, L = 1024, bf16 autocast: the eager rows, then the compiled ones (ten
    # compilations of one transformer block each, --compile_blocks: none starts after 300 s, the rows compiled by then
    # are timed). The step's limit keeps the call under 8 minutes, and the eager rows are in the JSON before the first
    # compilation.
    cp "$JSON" "$OUT/benchmarks_gpu.json" 2>/dev/null
    "$PY" -c "import torch.nn.attention.varlen as v; print('varlen_attn:', v.varlen_attn)" 2>&1 | tee -a "$OUT/packages.txt"
    step 420 gpu_packing "$PY" benchmarks/gpu.py --packing_only --merge_json --time_budget_s 300 --compile_blocks \
        --json "$OUT/benchmarks_gpu.json"
    ;;
quick)
    smoke_step 120
    step 120 end_to_end "$PY" benchmarks/end_to_end.py --folder /tmp/hf-vit-jpegs-quick --images 64 \
        --preset vit-tiny-patch16-224 --num_hidden_layers 2 --image_size 64 --batch_size 8 --steps 8 \
        --warmup_steps 2 --json "$OUT/end_to_end.json"
    step 120 gpu_quick "$PY" benchmarks/gpu.py --quick --json "$OUT/benchmarks_gpu.json"
    ;;
*)
    echo "unknown part $part: use 1, 2, 3, 4, packing, smoke or quick" >&2
    exit 2
    ;;
esac
exit $status
