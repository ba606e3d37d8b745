#!/usr/bin/env bash
# The slice decode kernel against the default path (runs THERE, from .device-carry as staged by
# `AB_OLD_BIN=<an earlier megamoe> bash scripts/device.sh`; first written as the thirty-third
# session's call 5): "slice" = this build under MEGAMOE_SLICE=1, "old" = the staged earlier binary
# under MEGAMOE_SLICE=1, "base" = this build's default path (the fused decode kernel), alternated;
# then a cluster-cap sweep (MEGAMOE_SLICE_CLUSTERS), ncu of both slice builds, the slice tests,
# verify and the golden fixtures under MEGAMOE_SLICE=1, memcheck and racecheck (hazards kept).
#   run(command="bash .device-carry/slice_ab.sh", carry=[".device-carry", ".peers"], timeout_s=480)
# Builds: "slice" = this build under MEGAMOE_SLICE=1, "old" = the staged earlier binary (also under
# MEGAMOE_SLICE=1), "base" = this build's default path.
# Knobs: ROUNDS (2; 0: no bench rows, only the checks), BUILDS ("slice old base"), WHOLE=0 (rank rows only), FLASH=0, SWEEP=1, NCU=0,
# NCU_T ("1 8"), TEST_BUILDS ("slice": the slice tests, memcheck and racecheck under each), VERIFY=0 (the verify sweep and the fixtures, under each of VERIFY_BUILDS: "slice"),
# MEMCHECK=0, RACE=0, SLICE_ENV (more
# environment for both slice builds and the slice tests and sanitizers, e.g. "MEGAMOE_SLICE_CLUSTERS=2":
# a CTA's ring refilled in the tests' small layer). For a small
# budget: ROUNDS=1 BUILDS="slice base" FLASH=0 NCU_T=1 VERIFY=0 MEMCHECK=0 (~150 s of command).
# shellcheck disable=SC1091
source .device-carry/call_env.sh   # OUT, C, the kernel cache, the fixtures (scripts/device/call_env.sh)
bin_of() { if [ "$1" = old ]; then echo $C/old/megamoe; else echo $C/bin/megamoe; fi; }
env_of() {
  case $1 in
    base) echo MEGAMOE_SLICE=0 ;;
    *) echo MEGAMOE_SLICE=1 ${SLICE_ENV:-} ;;
  esac
}
bench() {  # build-tag, extra env, args...
  local w=$1 extra=$2; shift 2
  env $(env_of $w) $extra MEGAMOE_LOG=megamoe=warn timeout 100 $(bin_of $w) bench forward --backend cuda "$@" 2>&1 | bench_rows
}
whole=--whole-layer; [ "${WHOLE:-1}" = 0 ] && whole=
builds=${BUILDS:-slice old base}
for r in $(seq 1 ${ROUNDS:-2}); do
  for w in $builds; do
    echo "== round $r $w pro" | tee -a $OUT/ab.txt
    bench $w "" --shape v4-pro --simulate-ep 8 $whole --tokens 1,8 --json $OUT/ab_pro_${w}_$r.json | tee -a $OUT/ab.txt
    { [ $r = 2 ] || [ "${FLASH:-1}" = 0 ]; } && continue   # V4-Flash once
    echo "== round $r $w flash" | tee -a $OUT/ab.txt
    bench $w "" --shape v4-flash $whole --tokens 1,8 --json $OUT/ab_flash_${w}_$r.json | tee -a $OUT/ab.txt
  done
done
if [ "${SWEEP:-0}" = 1 ]; then
  for n in 16 24 32 40; do
    echo "== slice clusters <= $n pro rank" | tee -a $OUT/ab.txt
    bench slice "MEGAMOE_SLICE_CLUSTERS=$n" --shape v4-pro --simulate-ep 8 --tokens 1,8 --json $OUT/sweep_$n.json | tee -a $OUT/ab.txt
  done
fi
echo "elapsed ${SECONDS}s"
if command -v ncu >/dev/null && [ "${NCU:-1}" = 1 ]; then
  m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size
  for t in ${NCU_T:-1 8}; do for w in $builds; do [ $w = base ] && continue
    echo "== ncu $w rank T=$t"
    env $(env_of $w) MEGAMOE_LOG=megamoe=warn timeout 60 ncu --clock-control none -k "regex:moe_slice" --launch-count 2 --metrics $m \
      $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens $t --iters 1 --runs 1 > $OUT/ncu_${w}_t$t.txt 2>&1
    awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|grid_size/{printf " %s=%s", $1, $NF}' $OUT/ncu_${w}_t$t.txt | sed 's/__/./g' | cut -c1-200; echo
  done; done
fi
# The slice tests under each of TEST_BUILDS (this build's environments; default "slice").
for w in ${TEST_BUILDS:-slice}; do
  echo "== slice tests, $(env_of $w)"
  env $(env_of $w) timeout 180 $C/bin/cuda_engine --test-threads=1 slice_ 2>&1 | grep -E "rel L2|test |panicked|SKIPPED|result" > $OUT/slice_tests_$w.txt; grep -E "test |panicked|result" $OUT/slice_tests_$w.txt
done
if [ "${VERIFY:-1}" = 1 ]; then
  for w in ${VERIFY_BUILDS:-slice}; do
    echo "== verify, $(env_of $w)"
    env $(env_of $w) MEGAMOE_LOG=megamoe=warn timeout 100 $(bin_of $w) verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
    if [ -x $C/bin/cuda_fixtures ] && [ $w != old ]; then
      echo "== golden fixtures, $(env_of $w)"
      env $(env_of $w) timeout 150 $C/bin/cuda_fixtures --test-threads 1 2>&1 | grep -E "^test |test result|panicked" | tee $OUT/fixtures_$w.txt
    fi
  done
fi
echo "elapsed ${SECONDS}s"
if command -v compute-sanitizer >/dev/null && [ "${MEMCHECK:-1}" = 1 ]; then
  for w in ${TEST_BUILDS:-slice}; do
    echo "== memcheck slice tests, $(env_of $w)"
    env $(env_of $w) timeout 100 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 slice_routed 2>&1 | grep -E "ERROR SUMMARY|test result|panicked|Invalid" | head -8
    if [ "${RACE:-1}" = 1 ]; then
      echo "== racecheck slice tests, $(env_of $w)"
      env $(env_of $w) timeout 120 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 $C/bin/cuda_engine --test-threads=1 slice_routed > $OUT/racecheck_$w.txt 2>&1
      grep -E "RACECHECK SUMMARY|test result|panicked" $OUT/racecheck_$w.txt | head; grep -E "hazard|Write|Read|at 0x|in " $OUT/racecheck_$w.txt | head -24
    fi
  done
fi
echo "elapsed ${SECONDS}s"
