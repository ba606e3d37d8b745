#!/usr/bin/env bash
# Session 37 call 2 (everything lands in one archive, $OUT/all.tgz: the device tool returns 8 files):
# the slice kernel with its busy clusters spread over the launch (this build) against HEAD's
# (old), both under MEGAMOE_SLICE=1, with the slice tests and a racecheck; the 4-CTAs-an-SM build's
# cluster occupancy (log line); the 5-D weight map A/B rows (no checks: GATE_PCT=100); ncu of
# every kernel of the EP-rank rows at T=4096.
set -uo pipefail
O="$OUT"; A=/tmp/s37/all; mkdir -p "$A"
pack() { tar -czf "$O/all.tmp.tgz" -C /tmp/s37 all 2>/dev/null && mv "$O/all.tmp.tgz" "$O/all.tgz"; }
# A call cut by its time limit still returns what it had: the archive is refreshed every 20 s.
( while sleep 20; do pack; done ) &
OUT=$A/slice BUILDS="slice old" ROUNDS=2 FLASH=0 NCU_T=1 VERIFY=1 VERIFY_BUILDS=slice MEMCHECK=0 \
  bash .device-carry/slice_ab.sh > $A/slice_ab.txt 2>&1
echo "== slice done ${SECONDS}s"; grep -E "==|v4-|test |result|SUMMARY|moe_slice|verify|elapsed" $A/slice_ab.txt | head -70; pack
source .device-carry/call_env.sh >/dev/null 2>&1
MEGAMOE_SLICE_CTAS_PER_SM=4 MEGAMOE_SLICE=1 timeout 60 .device-carry/bin/megamoe bench forward --backend cuda --shape v4-pro \
  --simulate-ep 8 --tokens 1 --iters 3 > $A/slice4_occupancy.txt 2>&1
MEGAMOE_SLICE=1 timeout 60 .device-carry/bin/megamoe bench forward --backend cuda --shape v4-pro \
  --simulate-ep 8 --tokens 1 --iters 3 > $A/slice3_occupancy.txt 2>&1
grep -h "clusters resident\|^v4-" $A/slice4_occupancy.txt $A/slice3_occupancy.txt | sed 's/\x1b\[[0-9;]*m//g'; pack
OUT=$A/wmap GATE_PCT=100 AB_ROUNDS=2 AB_TOKENS=4096,8192,16384 AB_SPECS=$'v4-pro nvfp4 w4a16\nv4-flash nvfp4 w4a16' \
  TEST_FILTER="prefill routed_forward repeat_runs" SKIP_DEMO=1 SANITIZE_TESTS=prefill_fitted RACECHECK_TESTS=prefill_two_group \
  SANITIZE_EP_TESTS=zzz_none EP_TEST_FILTER=zzz_none INITCHECK=0 TIMINGS=0 NCU=0 TEST_TIMEOUT=300 \
  bash .device-carry/ab_gate.sh > $A/wmap.txt 2>&1
grep -E "gate|SUMMARY|test result|panicked|verify:" $A/wmap.txt | head -20; pack
echo "== wmap done ${SECONDS}s"
OUT=$A/ncu SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 NCU_BENCH=1 NCU_TOKENS=4096 \
  bash .device-carry/run.sh > $A/ncu.txt 2>&1
grep -E "  moe_|gpu__time" $A/ncu.txt | head -60; pack
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null
