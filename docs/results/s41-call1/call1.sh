#!/usr/bin/env bash
# The forty-first session's kernels, staged for the next device call (no device was lent in the
# forty-first session): the zero rows written by the wgmma L1's idle producer warps (6cb74c9)
# against 9a83107 ("old") and against the same binary with MEGAMOE_ZERO_ROWS=0 ("nozero": the work
# off, the code in), alternated twice; ncu times of the L1 / L2 / combine at T=4096; the tests that
# run the new paths (the fold test now also poisons y; the zero-rows test runs the chained and
# separate wgmma launches), memcheck of the latter, verify, fixtures. The bench with both peers is
# call4.sh.
# Staged here by `BASE=9a83107 bash scripts/stage_calls.sh docs/results/s41-call1` (calls 2-4 too);
# run(command="bash .device-carry/call1.sh", carry=[".device-carry", ".peers"], timeout_s=600).
set -uo pipefail
CALL=s41c1 source .device-carry/call_env.sh
cat $A/gpu.txt
bin_of() { case $1 in new|nozero) echo $C/bin/megamoe;; old) echo $C/old/megamoe;; esac; }
env_of() { case $1 in nozero) echo MEGAMOE_ZERO_ROWS=0;; *) echo MEGAMOE_ZERO_ROWS=1;; esac; }
# 1. A/B: V4-Pro EP8 rank (and rank + shared) T=4096, 16384; the same at T=4096 with a bf16 y;
#    V4-Flash T=4096.
for r in 1 2; do
  for w in new nozero old; do
    b=$(bin_of $w); e=$(env_of $w)
    env $e MEGAMOE_LOG=megamoe=warn timeout 90 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 4096 --y-dtype bf16 --json $A/ab_${w}_probf16_r$r.json > $A/ab_${w}_probf16_r$r.txt 2>&1
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A new nozero old | tee $A/ab_table.txt
echo "== ab ${SECONDS}s"; pack
# 2. ncu: the L1, L2 and combine of one T=4096 forward per build (twice).
for i in 1 2; do for w in new nozero old; do
  env $(env_of $w) timeout 60 ncu --clock-control none -k "regex:moe_(wg|combine)" -c 3 --metrics gpu__time_duration.sum,dram__bytes_write.sum \
    $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 \
    | grep -E "moe_|gpu__time|dram__bytes" | tee -a $A/ncu_$w.txt | grep -E "moe_|gpu__time" | paste - - | awk -v w=$w '{print w, $1, $NF}'
done; done | tee $A/ncu_times.txt
echo "== ncu ${SECONDS}s"; pack
# 3. Checks of the new build.
timeout 240 $C/bin/cuda_engine --test-threads=1 routed_forward_folds routed_zero_rows prefill_chained prefill_three_consumer prefill_fitted \
  prefill_two_group repeat_runs shared_expert_forked fused_decode slice_decode > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result|zero rows from" $A/engine_tests.txt | head -40; pack
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 routed_zero_rows \
  > $A/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|test result" $A/memcheck.txt | head -2
timeout 100 $C/bin/megamoe verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
timeout 100 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
echo "== checks ${SECONDS}s"; pack
call_end
