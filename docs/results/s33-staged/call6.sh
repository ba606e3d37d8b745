#!/usr/bin/env bash
# Minimal form of call5 for a small device budget: slice (this build, MEGAMOE_SLICE=1) vs base
# (MEGAMOE_SLICE=0), V4-Pro rank / rank + shared / whole layer T = 1, 8; ncu of moe_slice at T=1;
# the slice tests.
# shellcheck disable=SC1091
source .device-carry/call_env.sh
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-14s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
bench() { local s=$1; shift; env MEGAMOE_SLICE=$s MEGAMOE_LOG=megamoe=warn timeout 80 $C/bin/megamoe bench forward --backend cuda "$@" 2>&1 | rows; }
for w in 1 0 1 0; do
  echo "== slice=$w pro" | tee -a $OUT/ab.txt
  bench $w --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_slice${w}_$SECONDS.json | tee -a $OUT/ab.txt
  [ $SECONDS -gt 100 ] && break
done
echo "elapsed ${SECONDS}s"
m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size
MEGAMOE_SLICE=1 MEGAMOE_LOG=megamoe=warn timeout 40 ncu --clock-control none -k "regex:moe_slice" --launch-count 2 --metrics $m \
  $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1 --iters 1 --runs 1 > $OUT/ncu_slice_t1.txt 2>&1
awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|grid_size/{printf " %s=%s", $1, $NF}' $OUT/ncu_slice_t1.txt | sed 's/__/./g' | cut -c1-200; echo
echo "== slice tests"
timeout 90 $C/bin/cuda_engine --test-threads=1 slice_ 2>&1 | grep -E "rel L2|test |panicked|SKIPPED|result" > $OUT/slice_tests.txt; grep -E "test |panicked|result" $OUT/slice_tests.txt
echo "elapsed ${SECONDS}s"
