#!/usr/bin/env bash
# Session 32, call 3: the slice-parallel decode kernel (MEGAMOE_SLICE=1 on the new build: "slice")
# against the same build without it ("new": + the mma.sync L2 as a programmatic dependent and bf16
# one-chunk stages), "mid" (+ the PDL patch only) and "old" (session 31's HEAD): decode and
# whole-layer rows alternated; then the slice tests (host model, separate stages, sanitizers),
# verify under MEGAMOE_SLICE=1, ncu of the slice kernel, and run.sh (tests, fixtures, verify,
# bench + peers) on the new build's defaults. SHORT=1: the A/B rows, slice tests and verify only.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1
mkdir -p "$MEGAMOE_CACHE" && tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
chmod +x $C/bin/* $C/old/megamoe $C/mid/megamoe
nvidia-smi --query-gpu=name --format=csv,noheader
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-14s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
bench() {  # build-tag, extra env, args...
  local w=$1 envs=$2; shift 2
  local b=$C/bin/megamoe; case $w in mid|old) b=$C/$w/megamoe;; esac
  env $envs MEGAMOE_LOG=megamoe=warn timeout 100 $b bench forward --backend cuda "$@" 2>&1 | rows
}
for r in 1 2; do
  for w in slice new mid old; do
    e="MEGAMOE_SLICE=0"; [ $w = slice ] && e="MEGAMOE_SLICE=1"
    echo "== round $r $w pro" | tee -a $OUT/ab.txt
    bench $w "$e" --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_${w}_$r.json | tee -a $OUT/ab.txt
    echo "== round $r $w flash" | tee -a $OUT/ab.txt
    bench $w "$e" --shape v4-flash --whole-layer --tokens 1,8 --json $OUT/ab_flash_${w}_$r.json | tee -a $OUT/ab.txt
  done
done
echo "elapsed ${SECONDS}s"
echo "== slice tests"
timeout 200 $C/bin/cuda_engine --test-threads=1 slice_ 2>&1 | grep -E "rel L2|test |panicked|SKIPPED|result" | tail -60 | tee $OUT/slice_tests.txt
echo "== verify under MEGAMOE_SLICE=1"; MEGAMOE_SLICE=1 MEGAMOE_LOG=megamoe=warn timeout 100 $C/bin/megamoe verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
echo "elapsed ${SECONDS}s"
if command -v compute-sanitizer >/dev/null; then
  echo "== memcheck slice tests"
  timeout 150 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 slice_routed 2>&1 | grep -E "ERROR SUMMARY|test result|panicked|Invalid" | head -8
  echo "== racecheck slice tests"
  timeout 150 compute-sanitizer --tool racecheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 slice_routed 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result|panicked|hazard" | head -8
fi
echo "elapsed ${SECONDS}s"
if command -v ncu >/dev/null; then
  m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,launch__cluster_dim_x
  for t in 1 8; do
    echo "== ncu slice rank T=$t"
    MEGAMOE_SLICE=1 MEGAMOE_LOG=megamoe=warn timeout 60 ncu --clock-control none -k "regex:moe_slice" --launch-count 2 --metrics $m \
      $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens $t --iters 1 --runs 1 > $OUT/ncu_slice_t$t.txt 2>&1
    awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|grid_size|registers|cluster/{printf " %s=%s", $1, $NF}' $OUT/ncu_slice_t$t.txt | sed 's/__/./g' | cut -c1-240; echo
  done
fi
echo "elapsed ${SECONDS}s"
[ "${SHORT:-0}" = 1 ] && exit 0
export TEST_FILTER="repeat_runs routed_forward_folds prefill_tiles hash_layer shared_expert_forked external_routing decode_split nan_rows nvfp4_all_modes trace_records fused_decode tiny_plan" TEST_TIMEOUT=200
export SANITIZE=1 SANITIZE_TIMEOUT=100 SANITIZE_TESTS="shared_expert_forked external_routing" RACECHECK_TESTS="shared_expert_forked" SANITIZE_EP_TESTS=zzz_none INITCHECK=0
export TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none BENCH=1 PEERS=1
bash $C/run.sh > "$OUT/run_stdout.txt" 2>&1
sed -n '/SUMMARY/,$p' "$OUT/run_stdout.txt" | grep -vE "INFO|^\s*$" | head -40
echo "elapsed ${SECONDS}s"
