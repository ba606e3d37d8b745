#!/usr/bin/env bash
# The fortieth session's last device call: the final build (1685543's kernels) — the bench with both
# peers in one run (run.sh BENCH=1 PEERS=1), the decode-path and fold tests, verify, fixtures, the
# ramp probe. Staged by `KCACHE_SEED=<unpacked cache> PRECOMPILE_PROBE=0 bash scripts/device.sh` +
# this script and scripts/build_probe.sh's ramp_probe copied into .device-carry/;
# run(command="bash .device-carry/call5.sh", carry=[".device-carry", ".peers"], timeout_s=420).
set -uo pipefail
A=/tmp/s40c5/all; mkdir -p "$A"; O0="$OUT"
OUT=$A source .device-carry/call_env.sh
pack() { pack_to "$A" "$O0"; }
pack_every "$A" "$O0"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  timeout 200 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -40; echo "== bench ${SECONDS}s"; pack
# SHORT=1 (a small device budget): the bench only (the kernels' checks ran in call 3 on the same SASS).
[ "${SHORT:-0}" = 1 ] && { echo "== short: done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack; exit 0; }
timeout 120 $C/bin/cuda_engine --test-threads=1 prefill_three_consumer routed_forward_folds repeat_runs slice_ fused_decode \
  > $A/engine_tests.txt 2>&1; grep -E "test result|panicked" $A/engine_tests.txt
timeout 100 $C/bin/megamoe verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
timeout 60 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
echo "== checks ${SECONDS}s"; pack
chmod +x .device-carry/ramp_probe 2>/dev/null
timeout 60 .device-carry/ramp_probe > $A/ramp_probe.txt 2>&1; sed -n 1,3p $A/ramp_probe.txt; grep -E "^ *(37|36|18|1[0-9]{3})" $A/ramp_probe.txt | head -30
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
