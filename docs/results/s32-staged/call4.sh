#!/usr/bin/env bash
# Session 32, call 4: the slice kernel after call 3 (spin waits on the cluster barriers, one empty
# arrival per warp, an 8-lane partial sum) — "slice" (MEGAMOE_SLICE=1) against "base" (the same
# build's default path) and "old" (session 31's HEAD), alternated; the slice tests, verify under
# MEGAMOE_SLICE=1, memcheck / racecheck of them (racecheck's hazards kept), ncu of the slice kernel.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1
mkdir -p "$MEGAMOE_CACHE" && tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
chmod +x $C/bin/*; builds="slice base"; [ -f $C/old/megamoe ] && chmod +x $C/old/megamoe && builds="slice base old"
nvidia-smi --query-gpu=name --format=csv,noheader
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-14s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
bench() {  # build-tag, env, args...
  local w=$1 envs=$2; shift 2
  local b=$C/bin/megamoe; [ $w = old ] && b=$C/old/megamoe
  env $envs MEGAMOE_LOG=megamoe=warn timeout 100 $b bench forward --backend cuda "$@" 2>&1 | rows
}
for r in $(seq 1 ${ROUNDS:-2}); do
  for w in $builds; do
    e="MEGAMOE_SLICE=0"; [ $w = slice ] && e="MEGAMOE_SLICE=1"
    echo "== round $r $w pro" | tee -a $OUT/ab.txt
    bench $w "$e" --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_${w}_$r.json | tee -a $OUT/ab.txt
    { [ $r = 2 ] || [ "${FLASH:-1}" = 0 ]; } && continue   # V4-Flash once (FLASH=0: never)
    echo "== round $r $w flash" | tee -a $OUT/ab.txt
    bench $w "$e" --shape v4-flash --whole-layer --tokens 1,8 --json $OUT/ab_flash_${w}_$r.json | tee -a $OUT/ab.txt
  done
done
echo "elapsed ${SECONDS}s"
if command -v ncu >/dev/null && [ "${NCU:-1}" = 1 ]; then
  m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size
  for t in 1; do
    echo "== ncu slice rank T=$t"
    MEGAMOE_SLICE=1 MEGAMOE_LOG=megamoe=warn timeout 60 ncu --clock-control none -k "regex:moe_slice" --launch-count 2 --metrics $m \
      $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens $t --iters 1 --runs 1 > $OUT/ncu_slice_t$t.txt 2>&1
    awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|grid_size/{printf " %s=%s", $1, $NF}' $OUT/ncu_slice_t$t.txt | sed 's/__/./g' | cut -c1-200; echo
  done
fi
echo "== slice tests"
timeout 120 $C/bin/cuda_engine --test-threads=1 slice_ 2>&1 | grep -E "rel L2|test |panicked|SKIPPED|result" | tail -60 > $OUT/slice_tests.txt; grep -E "test |panicked|result" $OUT/slice_tests.txt
[ "${VERIFY:-1}" = 1 ] && echo "== verify under MEGAMOE_SLICE=1" && MEGAMOE_SLICE=1 MEGAMOE_LOG=megamoe=warn timeout 100 $C/bin/megamoe verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
echo "elapsed ${SECONDS}s"
if command -v compute-sanitizer >/dev/null; then
  echo "== memcheck slice tests"
  timeout 100 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 slice_routed 2>&1 | grep -E "ERROR SUMMARY|test result|panicked|Invalid" | head -8
  echo "== racecheck slice tests"
  timeout 120 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 $C/bin/cuda_engine --test-threads=1 slice_routed > $OUT/racecheck_slice.txt 2>&1
  grep -E "RACECHECK SUMMARY|test result|panicked" $OUT/racecheck_slice.txt | head; grep -E "hazard|Write|Read|at 0x|in " $OUT/racecheck_slice.txt | head -24
fi
echo "elapsed ${SECONDS}s"
