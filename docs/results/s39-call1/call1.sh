#!/usr/bin/env bash
# Staged for the thirty-ninth session's first device call (copy to .device-carry/ after
# `KCACHE_SEED=<the last carry's cache> PRECOMPILE_PROBE=0 bash scripts/device.sh`, then
#   run(command="bash .device-carry/call1.sh", carry=[".device-carry", ".peers"], timeout_s=560)).
# One archive, $OUT/all.tgz, refreshed every 15 s (the device tool returns 8 files). In order of value:
# 1. the ramp probe (scripts/device/ramp_probe.cu, ~2 s): one-shot reads of a decode step's bytes from
#    a cold L2 — the practical floor of issue 9's T=1 row;
# 2. the slice kernel's tests, memcheck and racecheck with its ring refilled (two clusters);
# 3. the tests e88672a's 5-D weight map has not had on a GPU (routed-forward, repeat), with the prefill
#    and slice tests, verify and fixtures (the host model is parallel since fcb775e);
# 4. the bench with both peers and the same-routing rows (the standing for issues 9 and 10).
set -uo pipefail
O="$OUT"; A=/tmp/s39/all; mkdir -p "$A"
pack() { tar -czf "$O/all.tmp.tgz" -C /tmp/s39 all 2>/dev/null && mv "$O/all.tmp.tgz" "$O/all.tgz"; }
( while sleep 15; do pack; done ) &
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
# Built there when the machine has nvcc; else the binary built here (CUDA 13.0 nvcc wheels) and carried.
RP=/tmp/ramp_probe
if ! { command -v nvcc >/dev/null && nvcc -arch=sm_90a -O2 -o $RP scripts/device/ramp_probe.cu > $A/ramp_build.txt 2>&1; }; then
  RP=.device-carry/ramp_probe; echo "ramp probe: carried build" | tee -a $A/ramp_build.txt
fi
timeout 120 $RP > $A/ramp_probe.txt 2>&1; echo "ramp rc=$?" >> $A/ramp_probe.txt; head -80 $A/ramp_probe.txt
pack
# The slice kernel with its ring refilled: the tests' layer uses two stages of a CTA's ring at the
# default cluster count, so no racecheck so far saw a stage reused; two clusters give each CTA 8+
# units. Its tests, memcheck and racecheck under the cap (slice_ab.sh with no bench rounds).
OUT=$A/slice_cap2 ROUNDS=0 NCU=0 VERIFY=0 TEST_BUILDS=slice SLICE_ENV="MEGAMOE_SLICE_CLUSTERS=2" \
  bash .device-carry/slice_ab.sh > $A/slice_cap2.txt 2>&1
grep -E "==|test result|panicked|SUMMARY" $A/slice_cap2.txt | head -12
pack
OUT=$A/checks TEST_FILTER="routed_forward repeat_runs prefill slice_" TEST_TIMEOUT=300 SKIP_DEMO=1 SANITIZE=0 \
  INITCHECK=0 TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none bash .device-carry/run.sh > $A/checks.txt 2>&1
grep -E "SUMMARY|rc=|test result|panicked|verify:|FAIL" $A/checks.txt | cut -c1-200 | head -30; pack
echo "== checks done ${SECONDS}s"
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -vE "^\s*$" $A/bench.txt | tail -40 | cut -c1-200; pack
# The prefill rows with a bf16 y (what the peers write; the bench's default y is f32).
env MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_LOG=megamoe=warn timeout 120 .device-carry/bin/megamoe bench forward --backend cuda --shape v4-pro \
  --simulate-ep 8 --tokens 512,4096,16384 --y-dtype bf16 --json $A/bench_ybf16.json > $A/bench_ybf16.txt 2>&1
grep -E "rank|y bf16" $A/bench_ybf16.txt | cut -c1-200; pack
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
