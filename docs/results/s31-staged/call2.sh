#!/usr/bin/env bash
# Session 31, call 2: the mma.sync GEMMs' L2 as a programmatic dependent (weights before the wait;
# build "mid" = that alone, "new" = also one-chunk bf16 stages: 4-deep decode rings) against call 1's
# build ("old"): decode / whole-layer rows of the three builds alternated first; then tests,
# sanitizers over the shared-expert tests, fixtures, verify (new, mid, new under
# MEGAMOE_SLAB_WAVES=1), demo, bench, peers on the new build; ncu of the shared expert's kernels.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1
mkdir -p "$MEGAMOE_CACHE" && tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
chmod +x $C/bin/* $C/old/megamoe $C/mid/megamoe
nvidia-smi --query-gpu=name --format=csv,noheader
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
for r in 1 2; do
  for w in new mid old; do
    b=$C/bin/megamoe; [ $w != new ] && b=$C/$w/megamoe
    echo "== round $r $w pro" | tee -a $OUT/ab.txt; MEGAMOE_LOG=megamoe=warn timeout 100 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_${w}_$r.json 2>&1 | rows | grep -v " rank " | tee -a $OUT/ab.txt
    echo "== round $r $w flash" | tee -a $OUT/ab.txt; MEGAMOE_LOG=megamoe=warn timeout 100 $b bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 --json $OUT/ab_flash_${w}_$r.json 2>&1 | rows | grep -v " rank " | tee -a $OUT/ab.txt
  done
done
echo "== new + MEGAMOE_SLAB_WAVES=1 pro" | tee -a $OUT/ab.txt; MEGAMOE_LOG=megamoe=warn MEGAMOE_SLAB_WAVES=1 timeout 100 $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_new_waves.json 2>&1 | rows | grep -v " rank " | tee -a $OUT/ab.txt
echo "elapsed ${SECONDS}s"
echo "== verify mid"; MEGAMOE_LOG=megamoe=warn timeout 100 $C/mid/megamoe verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
echo "== verify + tests under MEGAMOE_SLAB_WAVES=1"; MEGAMOE_LOG=megamoe=warn MEGAMOE_SLAB_WAVES=1 timeout 100 $C/bin/megamoe verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
# (the tests under the knob ran in call 1)
export TEST_FILTER="repeat_runs routed_forward_folds prefill_tiles hash_layer shared_expert_forked external_routing decode_split nan_rows nvfp4_all_modes trace_records w4a8_fp8 large_batch tiny_plan" TEST_TIMEOUT=200
export SANITIZE=1 SANITIZE_TIMEOUT=120 SANITIZE_TESTS="shared_expert_forked external_routing w4a8_fp8 repeat_runs" RACECHECK_TESTS="shared_expert_forked external_routing" SANITIZE_EP_TESTS=zzz_none INITCHECK=0
export TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none BENCH=1 PEERS=1
bash $C/run.sh > "$OUT/run_stdout.txt" 2>&1
sed -n '/SUMMARY/,$p' "$OUT/run_stdout.txt" | grep -vE "INFO|^\s*$" | head -30
echo "elapsed ${SECONDS}s"
if command -v ncu >/dev/null && [ "$SECONDS" -lt 230 ]; then
  m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread
  echo "== ncu new rank+shared T=1: the shared expert's kernels"
  MEGAMOE_LOG=megamoe=warn timeout 80 ncu --clock-control none -k "regex:moe_tc_l" --launch-count 4 --metrics $m \
    $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1 --iters 1 --runs 1 > $OUT/ncu_t1_new.txt 2>&1
  awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|grid_size|registers/{printf " %s=%s", $1, $NF}' $OUT/ncu_t1_new.txt | sed 's/__/./g' | cut -c1-220; echo
fi
echo "elapsed ${SECONDS}s"
