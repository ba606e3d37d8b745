#!/usr/bin/env bash
# s41 call 5: the final build (MEGAMOE_WG_UNITS=auto by default, the zero rows): W4A8 A/B (call3),
# the fixed fold test and the units / zero-rows tests, verify, then the bench with both peers.
set -uo pipefail
CALL=s41c5 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
timeout 150 $C/bin/cuda_engine --test-threads=1 routed_forward_folds routed_zero_rows prefill_units_per_cta > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -10; pack
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  timeout 200 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -30; echo "== bench ${SECONDS}s"; pack
fp8_of() { case $1 in bf16) echo 0;; both) echo 1;; l2) echo l2;; esac; }
for r in 1 2; do
  for w in l2 both bf16; do
    f=$(fp8_of $w)
    MEGAMOE_W4A8_FP8=$f MEGAMOE_LOG=megamoe=warn timeout 100 $B bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --format mxfp4 --mode w4a8 --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A l2 both bf16 | tee $A/ab_table.txt; echo "== w4a8 ab ${SECONDS}s"; pack
timeout 120 $C/bin/cuda_engine --test-threads=1 --nocapture w4a8_fp8_prefill > $A/w4a8_test.txt 2>&1
grep -E "rel L2|^test |panicked|test result" $A/w4a8_test.txt | head -14; pack
timeout 100 $B verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
call_end
