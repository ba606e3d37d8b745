#!/usr/bin/env bash
# s42 call 2: the batched plan offsets + the combine's per-batch grid ("new", this build) against
# d5bf9f4 ("old"), alternated twice: V4-Pro EP8 rank T=64,512,4096,16384, V4-Flash T=4096; the plan /
# combine / staging kernels under ncu at T=4096 and 16384 for both; the plan / combine tests.
set -uo pipefail
CALL=s42c2 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
timeout 200 $C/bin/cuda_engine --test-threads=1 large_batch tiny_plan prefill_three_consumer prefill_fitted routed_forward_folds routed_zero_rows prefill_units_per_cta nvfp4_all_modes > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -12; echo "== tests ${SECONDS}s"; pack
bin_of() { case $1 in new) echo $C/bin/megamoe;; old) echo $C/old/megamoe;; esac; }
for r in 1 2; do
  for w in new old; do
    b=$(bin_of $w)
    MEGAMOE_LOG=megamoe=warn timeout 90 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 64,512,4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A new old | tee $A/ab_table.txt; echo "== ab ${SECONDS}s"; pack
for w in new old; do
  for t in 4096 16384; do
    timeout 60 ncu --clock-control none -k "regex:moe_(combine|quant|plan)" -c 6 --metrics gpu__time_duration.sum \
      $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens $t --iters 1 2>&1 \
      | grep -E "^  moe_|gpu__time" | paste - - | awk -v w=$w -v t=$t '{print w, t, $1, $NF}' | tee -a $A/ncu_small.txt
  done
done
call_end
