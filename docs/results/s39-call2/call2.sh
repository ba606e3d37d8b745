#!/usr/bin/env bash
# The thirty-ninth session's second device call (staged by
#   KCACHE_SEED=<the last carry's cache> PRECOMPILE_PROBE=0 bash scripts/device.sh
# at f49b11d, this script copied to .device-carry/; run(command="bash .device-carry/call2.sh",
# carry=[".device-carry", ".peers"], timeout_s=560)). One archive, $OUT/all.tgz, refreshed every 15 s.
# 1. the checks of the two kernel commits: the slice tests (the folded sum's bits against
#    moe_slice_sum's, y 4 bytes off a 256-byte boundary), memcheck and racecheck of the slice test,
#    the fused-decode, fold and split-counter tests, verify and the fixtures (trimmed to the budget
#    left after three failed starts);
# 2. the A/B of the folded slice sum: the same binary with MEGAMOE_FOLD=0 ("sum": moe_slice_sum as
#    before) and without ("fold"), alternated twice, V4-Pro EP8 rank T=1,8 and V4-Flash T=1,8;
# 3. the prefill rows with y in f32 and in bf16 (bench forward --y-dtype).
set -uo pipefail
A=/tmp/s39b/all; mkdir -p "$A"; O0="$OUT"
pack() { tar -czf "$O0/all.tmp.tgz" -C /tmp/s39b all 2>/dev/null && mv "$O0/all.tmp.tgz" "$O0/all.tgz"; }
( while sleep 15; do pack; done ) &
OUT=$A source .device-carry/call_env.sh   # the kernel cache, MEGAMOE_* paths, C
B=$C/bin/megamoe
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
t0=$SECONDS
for cl in default; do
  e=""; [ $cl = 2 ] && e="MEGAMOE_SLICE_CLUSTERS=2"
  echo "== slice tests, clusters $cl"
  env $e timeout 200 $C/bin/cuda_engine --test-threads=1 slice_ > $A/slice_tests_$cl.txt 2>&1
  grep -E "^test |panicked|test result" $A/slice_tests_$cl.txt | head -8
done
pack
echo "== memcheck / racecheck slice_routed"
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 slice_routed > $A/memcheck.txt 2>&1
grep -E "ERROR SUMMARY|test result|panicked" $A/memcheck.txt | head -3
timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 $C/bin/cuda_engine --test-threads=1 slice_routed > $A/racecheck.txt 2>&1
grep -E "RACECHECK SUMMARY|test result|panicked" $A/racecheck.txt | head -3
pack
echo "== engine tests"
timeout 150 $C/bin/cuda_engine --test-threads=1 fused_decode routed_forward_folds decode_split > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -12
timeout 100 $B verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
[ -x $C/bin/cuda_fixtures ] && timeout 150 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
echo "== checks ${SECONDS}s"; pack
rows() { grep -E "^v4-" | cut -c1-160; }
for r in 1 2; do
  for w in sum fold; do
    e=""; [ $w = sum ] && e="MEGAMOE_FOLD=0"
    echo "== round $r $w"
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $B bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1,8 \
      --json $A/ab_pro_${w}_$r.json 2>&1 | tee $A/ab_pro_${w}_$r.txt | rows
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $B bench forward --backend cuda --shape v4-flash --tokens 1,8 \
      --json $A/ab_flash_${w}_$r.json 2>&1 | tee $A/ab_flash_${w}_$r.txt | rows
  done; pack
done
echo "== A/B ${SECONDS}s"
for r in 1; do
  for y in f32 bf16; do
    echo "== round $r y $y"
    MEGAMOE_LOG=megamoe=warn timeout 120 $B bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1,512,4096,16384 \
      --y-dtype $y --json $A/y_${y}_$r.json 2>&1 | tee $A/y_${y}_$r.txt | rows
  done; pack
done
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
