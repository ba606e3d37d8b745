#!/usr/bin/env bash
# The forty-first session's second staged call (same staging as call1.sh; run right after it on the
# warm machine): MEGAMOE_WG_UNITS — each wgmma prefill CTA running n units back to back — swept on
# one binary (e190565+): n = 1 (the default), 2, 3 and auto, alternated twice, on the V4-Pro EP8
# rank at T=4096 / 16384 and V4-Flash at T=4096; ncu times of the wgmma L1 / L2 at T=4096 per n
# (launched alone, so a chained pair's overlap is not in them); the bitwise test of n > 1.
# run(command="bash .device-carry/call2.sh", carry=[".device-carry", ".peers"], timeout_s=600).
set -uo pipefail
CALL=s41c2 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
units_of() { case $1 in u1) echo 1;; u2) echo 2;; u3) echo 3;; uauto) echo auto;; esac; }
for r in 1 2; do
  for w in u2 u3 uauto u1; do
    u=$(units_of $w)
    MEGAMOE_WG_UNITS=$u MEGAMOE_LOG=megamoe=warn timeout 90 $B bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_WG_UNITS=$u MEGAMOE_LOG=megamoe=warn timeout 60 $B bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A u2 u3 uauto u1 | tee $A/ab_table.txt
echo "== ab ${SECONDS}s"; pack
for w in u1 u2 u3 uauto; do
  MEGAMOE_WG_UNITS=$(units_of $w) timeout 60 ncu --clock-control none -k "regex:moe_wg" -c 2 \
    --metrics gpu__time_duration.sum,launch__grid_size $B bench forward --backend cuda --shape v4-pro \
    --simulate-ep 8 --tokens 4096 --iters 1 2>&1 | grep -E "moe_wg|gpu__time|grid_size" | tee -a $A/ncu_$w.txt \
    | grep -E "moe_wg|gpu__time" | paste - - | awk -v w=$w '{print w, $1, $NF}'
done | tee $A/ncu_times.txt
echo "== ncu ${SECONDS}s"; pack
timeout 200 $C/bin/cuda_engine --test-threads=1 prefill_units_per_cta > $A/units_test.txt 2>&1
grep -E "^test |panicked|test result|bitwise equal" $A/units_test.txt | head -14
call_end
