#!/usr/bin/env bash
# Runs THERE (on the GPU machine, from the repository root, with .device-carry carried): the CUDA
# tests, the fixture tests, `megamoe verify`, compute-sanitizer memcheck/racecheck on a small
# forward, and timings; logs go to $OUT; a summary table is printed last.
# Env: VERIFY_ARGS (default: the full sweep), SKIP_VERIFY=1, TIMINGS=0 to skip timings.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# Step logs go to $LOGS and come back as one archive (the device tool returns at most 8 files).
OUT="${OUT:-/tmp/megamoe-out}"; LOGS="$OUT/logs"; mkdir -p "$LOGS"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE="/tmp/megamoe-kernels" MEGAMOE_TEST_DATA="$here/data" MEGAMOE_REQUIRE_GPU=1
export MEGAMOE_LOG="${MEGAMOE_LOG:-megamoe=info}"
declare -A status
step() { # name, command...
  local name="$1"; shift
  local t0=$(date +%s)
  echo "=== $name: $*" | tee -a "$OUT/log.txt"
  "$@" >"$LOGS/$name.log" 2>&1; local rc=$?
  tail -n 25 "$LOGS/$name.log"
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  echo "=== $name: rc=$rc" | tee -a "$OUT/log.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
chmod +x "$here"/bin/*
[ -x "$here/bin/cuda_engine" ] && step tests "$here/bin/cuda_engine" --test-threads 1 --nocapture
[ -x "$here/bin/cuda_fixtures" ] && step fixtures "$here/bin/cuda_fixtures" --test-threads 1 --nocapture
if [ "${SKIP_VERIFY:-0}" != 1 ]; then
  step verify timeout "${VERIFY_TIMEOUT:-300}" "$here/bin/megamoe" verify --backend cuda ${VERIFY_ARGS:-}
fi
# The main job on the GPU: the full V4-Pro layer (384 experts) against the CPU reference.
[ "${SKIP_DEMO:-0}" != 1 ] && step demo timeout 240 "$here/bin/megamoe" demo --backend cuda
# Diagnostics on the GPU: a clean trace, then a deliberately wrong weight transform (scales in
# the wrong layout) that trace must pin on the first expert GEMM.
act="$here/data/activations"
step trace_clean "$here/bin/megamoe" trace --backend cuda --checkpoint "$here/data/nvfp4-tiny" --layer 1 \
  --input "$act/nvfp4-L1-in.safetensors" --expect "$act/nvfp4-L1-expect.safetensors"
step trace_fault env MEGAMOE_FAULT=scale_layout "$here/bin/megamoe" trace --backend cuda \
  --checkpoint "$here/data/nvfp4-tiny" --layer 1 --input "$act/nvfp4-L1-in.safetensors"
step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 "$here/bin/cuda_engine" --test-threads 1 trace_records nan_rows repeat_runs
step racecheck compute-sanitizer --tool racecheck --error-exitcode 9 "$here/bin/cuda_engine" --test-threads 1 trace_records
if [ "${TIMINGS:-1}" != 0 ]; then
  step timings "$here/bin/megamoe" verify --backend cuda --timings-only
fi
echo; echo "================ SUMMARY ================"
for k in tests fixtures verify demo trace_clean trace_fault memcheck racecheck timings; do
  [ -n "${status[$k]:-}" ] && printf "%-10s %s\n" "$k" "${status[$k]}"
done
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS"/memcheck.log "$LOGS"/racecheck.log 2>/dev/null
grep -hE "^test result" "$LOGS"/tests.log "$LOGS"/fixtures.log 2>/dev/null
[ -f "$LOGS/verify.log" ] && grep -E "PASS|FAIL|passed|failed" "$LOGS/verify.log" | tail -n 3
grep -h "first divergence:" "$LOGS"/trace_*.log 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit 0
