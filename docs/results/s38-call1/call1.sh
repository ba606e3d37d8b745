#!/usr/bin/env bash
# Session 38 call 1 (one archive, $OUT/all.tgz): the slice kernel with its first-unit copies issued
# before the cluster barrier, at three and four CTAs an SM ("slice", "slice4"), against HEAD's
# ("old"), all under MEGAMOE_SLICE=1; the cluster-occupancy log line of both; the phase probe of
# both at T=1; the slice tests, verify, fixtures, memcheck and racecheck under both.
set -uo pipefail
O="$OUT"; A=/tmp/s38/all; mkdir -p "$A"
pack() { tar -czf "$O/all.tmp.tgz" -C /tmp/s38 all 2>/dev/null && mv "$O/all.tmp.tgz" "$O/all.tgz"; }
( while sleep 20; do pack; done ) &
source .device-carry/call_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
for n in 3 4; do
  MEGAMOE_LOG=megamoe=info MEGAMOE_SLICE_CTAS_PER_SM=$n MEGAMOE_SLICE=1 timeout 90 .device-carry/bin/megamoe bench forward --backend cuda \
    --shape v4-pro --simulate-ep 8 --tokens 1 --iters 3 > $A/occupancy_$n.txt 2>&1
  grep -h "slice decode kernel\|^v4-" $A/occupancy_$n.txt | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-220
done; pack
OUT=$A/slice BUILDS="slice slice4 old" ROUNDS=2 FLASH=0 NCU_T=1 TEST_BUILDS="slice slice4" VERIFY=1 \
  VERIFY_BUILDS="slice slice4" MEMCHECK=1 RACE=1 bash .device-carry/slice_ab.sh > $A/slice_ab.txt 2>&1 &
ab=$!
# The A/B rows come first; the probe after the A/B's benches (not beside them).
while kill -0 $ab 2>/dev/null && ! grep -q "elapsed" $A/slice_ab.txt; do sleep 2; done
grep -E "==|v4-|elapsed" $A/slice_ab.txt | head -40; pack
wait $ab
grep -E "== (ncu|slice|verify|golden|memcheck|racecheck)|moe_slice|test result|panicked|verify:|SUMMARY|elapsed" $A/slice_ab.txt | cut -c1-200 | head -60; pack
for n in 3 4; do
  MEGAMOE_PHASE_PROBE=1 MEGAMOE_SLICE_CTAS_PER_SM=$n MEGAMOE_SLICE=1 timeout 120 .device-carry/bin/megamoe bench forward --backend cuda \
    --shape v4-pro --simulate-ep 8 --tokens 1,8 --iters 5 > $A/probe_$n.txt 2>&1
  echo "== probe $n"; sed 's/\x1b\[[0-9;]*m//g' $A/probe_$n.txt | grep -vE "^\s*$" | tail -30 | cut -c1-160
done
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
