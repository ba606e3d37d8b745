#!/usr/bin/env bash
# The thirty-ninth session's third device call: the final build's checks and rows (staged by
#   KCACHE_SEED=<the last carry's cache> PRECOMPILE_PROBE=0 bash scripts/device.sh
# after the folded sum's revert, this script and the ramp probe's binary copied into .device-carry/;
# run(command="bash .device-carry/call3.sh", carry=[".device-carry", ".peers"], timeout_s=300),
# ideally on an H200). One archive, $OUT/all.tgz, refreshed every 15 s.
set -uo pipefail
A=/tmp/s39c/all; mkdir -p "$A"; O0="$OUT"
OUT=$A source .device-carry/call_env.sh   # the kernel cache, MEGAMOE_* paths, C, pack_to / pack_every
pack() { pack_to "$A" "$O0"; }
pack_every "$A" "$O0"
B=$C/bin/megamoe
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
timeout 100 $C/bin/cuda_engine --test-threads=1 slice_ fused_decode routed_forward_folds > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -8
timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 slice_routed > $A/memcheck.txt 2>&1
grep -E "ERROR SUMMARY|test result" $A/memcheck.txt | head -2
timeout 100 $B verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
timeout 100 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
echo "== checks ${SECONDS}s"; pack
MEGAMOE_LOG=megamoe=warn timeout 100 $B bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1,8,64,4096 \
  --json $A/bench_pro.json 2>&1 | tee $A/bench_pro.txt | grep -E "^v4-" | cut -c1-160
MEGAMOE_LOG=megamoe=warn timeout 80 $B bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 \
  --json $A/bench_flash.json 2>&1 | tee $A/bench_flash.txt | grep -E "^v4-" | cut -c1-160
# The ramp probe on this GPU (it has run on an H100 only: call 1), when its binary was carried
# (`.device-carry/ramp_probe`, built here with the CUDA 13.0 nvcc wheels; the device has no nvcc).
if [ -x .device-carry/ramp_probe ] || chmod +x .device-carry/ramp_probe 2>/dev/null; then
  timeout 120 .device-carry/ramp_probe > $A/ramp_probe.txt 2>&1; head -30 $A/ramp_probe.txt
fi
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
