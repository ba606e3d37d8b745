#!/usr/bin/env bash
# Session 31, call 1: HEAD + the opt-in MEGAMOE_SLAB_WAVES knob. Tests (also under the knob),
# verify, fixtures, demo, the EP-rank bench + whole layers + V4-Flash (rank+shared rows at every T
# on the engine's forward), the peers and the peer-routing rows; the decode rows under
# MEGAMOE_SLAB_WAVES=1; ncu of the shared expert's and the routed stages' kernels at T=1.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export TEST_FILTER="repeat_runs routed_forward_folds prefill_tiles hash_layer shared_expert_forked external_routing decode_split nan_rows" TEST_TIMEOUT=300
export SANITIZE=0 INITCHECK=0 TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none BENCH=1 PEERS=1
export BENCH_AB="MEGAMOE_SLAB_WAVES=1" BENCH_AB_TOKENS=1,8,64,512
export SWEEP="flash_waves MEGAMOE_SLAB_WAVES=1 -- --shape v4-flash --whole-layer --tokens 1,64
flash_base MEGAMOE_SLAB_WAVES=0 -- --shape v4-flash --whole-layer --tokens 1,64"
bash $C/run.sh > "$OUT/run_stdout.txt" 2>&1
sed -n '/SUMMARY/,$p' "$OUT/run_stdout.txt" | grep -vE "INFO|^\s*$" | head -40
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_LOG=megamoe=warn
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1
b=$C/bin/megamoe
echo "elapsed ${SECONDS}s"
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
for f in bench bench_ab sweep_flash_base sweep_flash_waves bench_flash; do
  echo "== $f"; grep -E "^v4-" $OUT/logs/$f.log | awk '{printf "  %-8s %-12s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'
done
echo "== tests under MEGAMOE_SLAB_WAVES=1"
MEGAMOE_SLAB_WAVES=1 timeout 150 $C/bin/cuda_engine --test-threads 1 shared_expert_forked repeat_runs external_routing nvfp4_all_modes decode_split 2>&1 | grep -E "test result|FAILED|panicked" | head
MEGAMOE_SLAB_WAVES=1 timeout 100 $b verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
if command -v ncu >/dev/null; then
  m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,launch__occupancy_limit_shared_mem
  for w in 0 1; do
    echo "== ncu rank+shared T=1 (SLAB_WAVES=$w): shared expert's and routed stages' kernels"
    MEGAMOE_SLAB_WAVES=$w timeout 150 ncu --clock-control none -k "regex:moe_(tc|ds)_l|moe_plan|moe_combine" --launch-count 12 --metrics $m \
      $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1 --iters 1 --runs 1 > $OUT/ncu_t1_w$w.txt 2>&1
    awk '/^  moe_/{printf "\n%s %s", $1, $2} /gpu__time|dram__bytes|dram__thr|warps_active|grid_size|occupancy_limit/{printf " %s=%s", $1, $NF}' $OUT/ncu_t1_w$w.txt | sed 's/__/./g' | cut -c1-260; echo
  done
  echo "== ncu flash whole T=1: shared expert's kernels"
  timeout 150 ncu --clock-control none -k "regex:moe_tc_l" --launch-count 4 --metrics $m \
    $b bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 --iters 1 --runs 1 > $OUT/ncu_flash_t1.txt 2>&1
  grep -E "^\s+moe_|gpu__time|dram__thr|grid_size" $OUT/ncu_flash_t1.txt | head -24
fi
echo "elapsed ${SECONDS}s"
