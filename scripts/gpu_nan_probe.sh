#!/usr/bin/env bash
# Device probe for the non-flash-attention NaN logits (scripts/gpu_nan_probe.py); set-up: scripts/gpu_env.sh.
#   run(command="bash scripts/gpu_nan_probe.sh", carry=[".gpu"], timeout_s=200)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$(date +%s)
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/kvagent-site}
BUNDLE=${GPU_CHECK_BUNDLE:-$ROOT/.gpu}
OUTDIR=${OUT:-/tmp/gpu-nan-out}
mkdir -p "$OUTDIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
source "$ROOT/scripts/gpu_env.sh"
gpu_env_setup || exit 1
echo "== setup done in $(( $(date +%s) - START )) s"

timeout --kill-after=5 ${PROBE_TIMEOUT:-110} $PY scripts/gpu_nan_probe.py --model "$MODEL" --gpu-layers -1 --cpu-too \
    --deadline ${PROBE_DEADLINE:-90} --json "$OUTDIR/nan_probe.json" 2>"$OUTDIR/probe-stderr.log"
echo "probe rc=$? after $(( $(date +%s) - START )) s"
grep -iE "error|abort|cuda|nan|fail" "$OUTDIR/probe-stderr.log" | grep -v "^load_tensors\|^print_info" | sort | uniq -c | sort -rn | head -8

# extra evidence, time permitting: the first failing integration test and the one before it, fa off, all layers
LEFT=$(( ${TOTAL_BUDGET:-150} - ($(date +%s) - START) - 5 ))
if [ "$LEFT" -gt 20 ]; then
    [ "$LEFT" -gt 40 ] && LEFT=40
    KVAGENT_TEST_MODELS=smollm2-135m KVAGENT_TEST_MODEL_FILES=smollm2-135m=$MODEL KVAGENT_GPU_LAYERS=-1 KVAGENT_FLASH_ATTN=0 \
        timeout --kill-after=5 $LEFT $PY -m pytest -q -p no:cacheprovider tests/integration/test_skills.py \
        -k "include_transplants or behind_its_own_sink or several_skills" 2>&1 | tail -4
fi
echo "== done in $(( $(date +%s) - START )) s"
