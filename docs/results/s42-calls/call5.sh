#!/usr/bin/env bash
# s42 call 5: the final build ("new": narrower widths in steps of 16, batched plan offsets, the
# combine's per-batch grid only where it skips tokens) — the combine / shared / prefill tests,
# fixtures, verify; once against "old" = d5bf9f4 (rank, rank + shared T=4096 / 16384,
# V4-Flash 4096); then the bench with both peers in the same run.
set -uo pipefail
CALL=s42c5 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
timeout 130 $C/bin/cuda_engine --test-threads=1 shared_expert nvfp4_all_modes prefill_fitted routed_forward_folds large_batch > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -12; pack
timeout 60 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
timeout 110 $B verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3; echo "== checks ${SECONDS}s"; pack
bin_of() { case $1 in new) echo $C/bin/megamoe;; old) echo $C/old/megamoe;; esac; }
for r in 1; do
  for w in new old; do
    MEGAMOE_LOG=megamoe=warn timeout 60 $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_LOG=megamoe=warn timeout 40 $(bin_of $w) bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
  python3 .device-carry/ab_table.py $A new old > $A/ab_table.txt; pack
done
cat $A/ab_table.txt; echo "== ab ${SECONDS}s"
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  timeout 200 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -30; echo "== bench ${SECONDS}s"
call_end
