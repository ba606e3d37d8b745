#!/usr/bin/env bash
# s42 call 3: three builds alternated twice — "old" = d5bf9f4 (the forty-first session's), "mid" =
# b061755 (+ batched plan offsets, the combine's per-batch grid), "new" = this build (+ narrower
# wgmma widths in steps of 16: an 80-token tile's experts of <= 64 rows on n64, not n72) — V4-Pro
# EP8 rank T=512,4096,8192,16384, V4-Flash T=4096; ncu of the wgmma GEMMs and small stages at
# T=4096; the prefill / plan / combine tests on "new" first.
set -uo pipefail
CALL=s42c3 source .device-carry/call_env.sh
cat $A/gpu.txt
chmod +x $C/mid/megamoe 2>/dev/null
timeout 240 $C/bin/cuda_engine --test-threads=1 prefill large_batch tiny_plan routed_forward_folds routed_zero_rows nvfp4_all_modes > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -20; echo "== tests ${SECONDS}s"; pack
bin_of() { case $1 in new) echo $C/bin/megamoe;; mid) echo $C/mid/megamoe;; old) echo $C/old/megamoe;; esac; }
for r in 1 2; do
  for w in new mid old; do
    b=$(bin_of $w)
    MEGAMOE_LOG=megamoe=warn timeout 90 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 512,4096,8192,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
  python3 .device-carry/ab_table.py $A new mid old > $A/ab_table.txt; pack
done
cat $A/ab_table.txt; echo "== ab ${SECONDS}s"
for w in new old; do
  timeout 60 ncu --clock-control none -k "regex:moe_(wg|combine|quant|plan)" -c 8 --metrics gpu__time_duration.sum \
    $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 \
    | grep -E "^  moe_|gpu__time" | paste - - | awk -v w=$w '{print w, $1, $NF}' | tee -a $A/ncu_times.txt
done
call_end
