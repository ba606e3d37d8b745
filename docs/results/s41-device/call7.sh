#!/usr/bin/env bash
# s41 call 7: the final build's bench with both peers and the ramp probe (asked on an H200).
set -uo pipefail
CALL=s41c7 source .device-carry/call_env.sh
cat $A/gpu.txt
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 RAMP_PROBE=1 \
  timeout 300 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -30
timeout 60 $C/bin/megamoe verify --backend cuda --quick > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
call_end
