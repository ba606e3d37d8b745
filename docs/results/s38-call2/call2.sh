#!/usr/bin/env bash
# Session 38 call 2 (one archive, $OUT/all.tgz): the 5-D weight map of the wgmma prefill kernels
# (this build = 18d1ee8 + docs/results/wg-weight-map-5d-2026-12-07-s36.patch) against 18d1ee8's
# kernels (old = 7974732's binary, same kernels): alternated rows at T=4096 and 16384, then — regardless
# of the gate — its prefill / routed-forward / repeat tests, verify, fixtures, a memcheck and a
# racecheck; then the peers (torch baselines, triton_kernels) and this build's EP-rank bench rows.
set -uo pipefail
O="$OUT"; A=/tmp/s38b/all; mkdir -p "$A"
pack() { tar -czf "$O/all.tmp.tgz" -C /tmp/s38b all 2>/dev/null && mv "$O/all.tmp.tgz" "$O/all.tgz"; }
( while sleep 15; do pack; done ) &
nvidia-smi --query-gpu=name --format=csv,noheader | tee $A/gpu.txt
OUT=$A/wmap FORCE=1 GATE_PCT=0.3 AB_ROUNDS=2 AB_TOKENS=4096,16384 AB_SPECS=$'v4-pro nvfp4 w4a16\nv4-flash nvfp4 w4a16' \
  TEST_FILTER="prefill routed_forward repeat_runs" SKIP_DEMO=1 SANITIZE_TESTS=prefill_fitted RACECHECK_TESTS=prefill_two_group \
  SANITIZE_EP_TESTS=zzz_none EP_TEST_FILTER=zzz_none INITCHECK=0 TIMINGS=0 NCU=0 TEST_TIMEOUT=240 \
  bash .device-carry/ab_gate.sh > $A/wmap.txt 2>&1
grep -E "gate|SUMMARY|test result|panicked|verify:|FAIL|v4-" $A/wmap.txt | cut -c1-200 | head -50; pack
echo "== wmap done ${SECONDS}s"
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 BENCH_TOKENS=1,8,64,512,4096,16384 \
  FLASH_TOKENS=1,4096 PEERS=1 PEER_ROUTING=0 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -vE "^\s*$" $A/bench.txt | tail -40 | cut -c1-200; pack
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
