#!/usr/bin/env bash
# s42 call 3: "new" = this build (1f89c3f: narrower wgmma widths in steps of 16 — an 80-token
# tile's experts of <= 64 rows on n64, not n72 —, batched plan offsets, the combine's per-batch
# grid) against "old" = d5bf9f4 (the forty-first session's), alternated twice: V4-Pro EP8 rank
# T=4096,16384, V4-Flash T=4096; ncu of both builds' kernels at T=4096; the prefill / plan / fold
# tests first; then the bench of "new" with both peers (run.sh BENCH=1 PEERS=1).
set -uo pipefail
CALL=s42c3 source .device-carry/call_env.sh
cat $A/gpu.txt
timeout 120 $C/bin/cuda_engine --test-threads=1 prefill_fitted prefill_three_consumer large_batch routed_forward_folds > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -12; echo "== tests ${SECONDS}s"; pack
bin_of() { case $1 in new) echo $C/bin/megamoe;; mid) echo $C/mid/megamoe;; old) echo $C/old/megamoe;; esac; }
for r in 1 2; do
  for w in new old; do
    b=$(bin_of $w)
    MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_LOG=megamoe=warn timeout 40 $b bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
  python3 .device-carry/ab_table.py $A new old > $A/ab_table.txt; pack
done
cat $A/ab_table.txt; echo "== ab ${SECONDS}s"
for w in new old; do
  timeout 45 ncu --clock-control none -k "regex:moe_(wg|combine|quant|plan)" -c 8 --metrics gpu__time_duration.sum \
    $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 \
    | grep -E "^  moe_|gpu__time" | paste - - | awk -v w=$w '{print w, $1, $NF}' | tee -a $A/ncu_times.txt
done
echo "== ncu ${SECONDS}s"; pack
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  timeout 230 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -30; echo "== bench ${SECONDS}s"
call_end
