#!/usr/bin/env bash
# s42 call 1: 467fcee's build on whatever card comes (an H200 wanted): the routed diagnostics'
# tests (467fcee changed them), fixtures, verify, the bench with both peers, ncu times at T=4096.
set -uo pipefail
CALL=s42c1 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
timeout 120 $C/bin/cuda_engine --test-threads=1 routed_forward_folds routed_zero_rows prefill_units_per_cta > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -10; pack
timeout 60 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  timeout 220 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -30; echo "== bench ${SECONDS}s"; pack
timeout 100 $B verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3; pack
timeout 60 ncu --clock-control none -k "regex:moe_(wg|combine|quant|plan)" -c 8 --metrics gpu__time_duration.sum \
  $B bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 | grep -E "^  moe_|gpu__time" | paste - - | awk '{print $1, $NF}' | tee $A/ncu_times.txt
call_end
