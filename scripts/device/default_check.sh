#!/usr/bin/env bash
# The default decode path against MEGAMOE_SLICE=0 (runs THERE, from .device-carry as staged by
# scripts/device.sh; thirty-fifth session): the V4-Pro EP8 rank rows (rank, rank + shared, whole
# layer) at T=1 and 8, alternated over ROUNDS (2); V4-Flash whole layer at T=1; then the CUDA tests
# of the decode paths, the verify sweep and the golden fixtures on the default path.
#   run(command="bash .device-carry/default_check.sh", carry=[".device-carry"], timeout_s=400)
# RACE=1 adds racecheck of the slice routed test (this build, and .device-carry/old/cuda_engine if staged).
# shellcheck disable=SC1091
source .device-carry/call_env.sh   # OUT, C, the kernel cache, the fixtures (scripts/device/call_env.sh)
bench() {  # extra env, args...
  local extra=$1; shift
  env $extra MEGAMOE_LOG=megamoe=warn timeout 100 $C/bin/megamoe bench forward --backend cuda "$@" 2>&1 | bench_rows
}
for r in $(seq 1 ${ROUNDS:-2}); do
  for e in MEGAMOE_SLICE= MEGAMOE_SLICE=0; do
    echo "== round $r ${e} v4-pro rank" | tee -a $OUT/rows.txt
    bench $e --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/pro_${e#*=}_$r.json | tee -a $OUT/rows.txt
  done
done
for e in MEGAMOE_SLICE= MEGAMOE_SLICE=0; do
  echo "== ${e} v4-flash" | tee -a $OUT/rows.txt
  bench $e --shape v4-flash --whole-layer --tokens 1 | tee -a $OUT/rows.txt
done
echo "elapsed ${SECONDS}s"
echo "== CUDA tests (${TESTS:-slice_ decode_path shared_expert_forked repeat_runs enqueue_ routed_forward})"
# shellcheck disable=SC2086
timeout 240 $C/bin/cuda_engine --test-threads=1 ${TESTS:-slice_ decode_path shared_expert_forked repeat_runs enqueue_ routed_forward} 2>&1 \
  | grep -E "^test |test result|panicked" | tee $OUT/tests.txt | grep -vE " ok$"
echo "elapsed ${SECONDS}s"
echo "== verify (default path)"
MEGAMOE_LOG=megamoe=warn timeout 100 $C/bin/megamoe verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
echo "== golden fixtures (default path)"
timeout 100 $C/bin/cuda_fixtures --test-threads 1 2>&1 | grep -E "^test |test result|panicked"
echo "elapsed ${SECONDS}s"
# RACE=1: racecheck of the slice kernel's routed test on this build, and on an earlier build's test
# executable where one is staged as .device-carry/old/cuda_engine (an A/B of a hazard report).
if [ "${RACE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for b in $C/bin/cuda_engine $C/old/cuda_engine; do
    [ -x $b ] || continue
    log=$OUT/racecheck_$(basename $(dirname $b)).txt   # racecheck_bin.txt / racecheck_old.txt
    echo "== racecheck slice_routed_forward_matches_separate_stages ($b)"
    timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 4 $b --test-threads=1 slice_routed > $log 2>&1
    grep -E "RACECHECK SUMMARY|test result|panicked" $log | head -4
    grep -E "hazard detected|Read Thread|Write Thread" $log | head -6
  done
  echo "elapsed ${SECONDS}s"
fi
