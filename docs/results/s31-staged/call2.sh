#!/usr/bin/env bash
# Session 31's staged call 2 (stage.sh stages it): the mma.sync GEMMs' L2 as a programmatic
# dependent (weights before the wait; build "mid" = that alone, "new" = also one-chunk bf16 stages:
# 4-deep decode rings) against HEAD ("old"): the decode / whole-layer rows of the three builds
# alternated first (ab.txt), the new build under MEGAMOE_SLAB_WAVES=1; then verify (mid, new under the
# knob) and, on the new build, run.sh's tests, sanitizers over the shared-expert tests, fixtures,
# verify, demo, bench and peers, and ncu of the shared expert's T=1 kernels.
# SHORT=1 (little device time): the A/B rows, then verify (new, mid), tests, fixtures, sanitizers only.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1
mkdir -p "$MEGAMOE_CACHE" && tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
chmod +x $C/bin/* $C/old/megamoe $C/mid/megamoe
nvidia-smi --query-gpu=name --format=csv,noheader
bin() { if [ "$1" = new ]; then echo $C/bin/megamoe; else echo $C/$1/megamoe; fi; }
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms (min %s) ratio %s\n", $1, $6, $7, $10, $11, $15}'; }
bench() { # tag, env, builds' bench options
  local tag=$1 env=$2; shift 2
  echo "== $tag" | tee -a $OUT/ab.txt
  env MEGAMOE_LOG=megamoe=warn $env timeout 100 "$@" --json $OUT/ab_$tag.json 2>&1 | rows | grep -v " rank " | tee -a $OUT/ab.txt
}
for r in 1 2; do
  for w in new mid old; do
    bench "pro_${w}_$r" "" $(bin $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8
    bench "flash_${w}_$r" "" $(bin $w) bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1
  done
done
bench pro_new_waves MEGAMOE_SLAB_WAVES=1 $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8
echo "elapsed ${SECONDS}s"
verify() { echo "== verify $1 $2"; env MEGAMOE_LOG=megamoe=warn $2 timeout 100 $(bin $1) verify --backend cuda > $OUT/verify_$1.txt 2>&1
  grep -E "verify:|FAIL|backend under" $OUT/verify_$1.txt | head -5; }
verify mid
verify new MEGAMOE_SLAB_WAVES=1
if [ "${SHORT:-0}" = 1 ]; then
  verify new
  echo "== tests new"; timeout 120 $C/bin/cuda_engine --test-threads 1 shared_expert_forked repeat_runs external_routing \
    w4a8_fp8 decode_split nan_rows nvfp4_all_modes trace_records > $OUT/tests.txt 2>&1; grep -E "^test |test result" $OUT/tests.txt | tail -12
  echo "== fixtures new"; timeout 60 $C/bin/cuda_fixtures --test-threads 1 2>&1 | grep -E "test result"
  for tool in memcheck racecheck; do echo "== $tool"; timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 \
    $C/bin/cuda_engine --test-threads 1 shared_expert_forked external_routing > $OUT/$tool.txt 2>&1
    echo "rc=$? $(grep -E 'ERROR SUMMARY|test result' $OUT/$tool.txt | tr '\n' ' ')"; done
  echo "elapsed ${SECONDS}s"; exit 0
fi
export TEST_FILTER="repeat_runs routed_forward_folds prefill_tiles hash_layer shared_expert_forked external_routing decode_split nan_rows nvfp4_all_modes trace_records w4a8_fp8 large_batch tiny_plan" TEST_TIMEOUT=200
export SANITIZE=1 SANITIZE_TIMEOUT=120 SANITIZE_TESTS="shared_expert_forked external_routing w4a8_fp8 repeat_runs" RACECHECK_TESTS="shared_expert_forked external_routing" SANITIZE_EP_TESTS=zzz_none INITCHECK=0
export TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none BENCH=1 PEERS=1
bash $C/run.sh > "$OUT/run_stdout.txt" 2>&1
sed -n '/SUMMARY/,$p' "$OUT/run_stdout.txt" | grep -vE "INFO|^\s*$" | head -30
echo "elapsed ${SECONDS}s"
if command -v ncu >/dev/null && [ "$SECONDS" -lt 400 ]; then
  m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread
  for w in new mid; do
    echo "== ncu $w rank+shared T=1: the shared expert's kernels"
    MEGAMOE_LOG=megamoe=warn timeout 80 ncu --clock-control none -k "regex:moe_tc_l" --launch-count 4 --metrics $m \
      $(bin $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1 --iters 1 --runs 1 > $OUT/ncu_t1_$w.txt 2>&1
    awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|grid_size|registers/{printf " %s=%s", $1, $NF}' $OUT/ncu_t1_$w.txt | sed 's/__/./g' | cut -c1-220; echo
  done
fi
echo "elapsed ${SECONDS}s"
