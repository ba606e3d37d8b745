#!/usr/bin/env bash
# Smallest form: slice vs base on the V4-Pro EP8 rank at T = 1, 8 (rank and rank + shared rows),
# then the slice tests while time lasts.
# shellcheck disable=SC1091
source .device-carry/call_env.sh
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-14s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
for w in 1 0 1 0; do
  echo "== slice=$w pro rank (${SECONDS}s)" | tee -a $OUT/ab.txt
  MEGAMOE_SLICE=$w MEGAMOE_LOG=megamoe=warn timeout 40 $C/bin/megamoe bench forward --backend cuda --shape v4-pro \
    --simulate-ep 8 --tokens 1,8 --json $OUT/ab_slice${w}_$SECONDS.json 2>&1 | rows | tee -a $OUT/ab.txt
done
echo "== slice tests (${SECONDS}s)"
timeout 60 $C/bin/cuda_engine --test-threads=1 slice_ 2>&1 | grep -E "rel L2|test |panicked|SKIPPED|result" | tee $OUT/slice_tests.txt
echo "elapsed ${SECONDS}s"
