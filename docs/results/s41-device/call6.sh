#!/usr/bin/env bash
# s41 call 6: the final build's checks under its new default (auto units a CTA): the prefill /
# routed / repeat tests, fixtures, memcheck of the three-consumer prefill, verify under
# MEGAMOE_W4A8_FP8=l2, ncu times at T=4096.
set -uo pipefail
CALL=s41c6 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
timeout 260 $C/bin/cuda_engine --test-threads=1 prefill routed repeat_runs shared_expert w4a16 > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -30; pack
timeout 60 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
timeout 100 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 prefill_three_consumer \
  > $A/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|test result" $A/memcheck.txt | head -2; pack
MEGAMOE_W4A8_FP8=l2 timeout 100 $B verify --backend cuda > $A/verify_l2.txt 2>&1; grep -E "verify:|FAIL" $A/verify_l2.txt | head -3
timeout 60 ncu --clock-control none -k "regex:moe_(wg|combine|quant|plan)" -c 8 --metrics gpu__time_duration.sum \
  $B bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 | grep -E "^  moe_|gpu__time" | paste - - | awk '{print $1, $NF}' | tee $A/ncu_times.txt
call_end
