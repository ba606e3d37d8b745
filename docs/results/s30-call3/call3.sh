#!/usr/bin/env bash
# Session 30, call 3: the final build (f0128f7 + the router's score pass / top-k keys unrolled) —
# tests, sanitizers over the routing tests, fixtures, the full verify sweep, the demo, the EP-rank
# bench + whole layers + V4-Flash, the peers and the rank rows on the peer's routing draw; then the
# whole-layer rows against 26f1b68's build, the V4-Flash whole layer with a 64 KB L2 prefetch, and
# ncu of the router / plan kernels.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export TEST_FILTER="router hash_layer nan_rows repeat_runs shared_expert_forked tiny_plan large_batch external_routing fused_decode decode_split routed_forward_folds prefill_tiles bad_input" TEST_TIMEOUT=300
export SANITIZE=1 SANITIZE_TIMEOUT=90 SANITIZE_TESTS="nan_rows hash_layer" RACECHECK_TESTS="hash_layer" SANITIZE_EP_TESTS=zzz_none INITCHECK=0
export TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none BENCH=1 PEERS=1
bash $C/run.sh > "$OUT/run_stdout.txt" 2>&1
sed -n '/SUMMARY/,$p' "$OUT/run_stdout.txt" | grep -vE "INFO|^\s*$" | head -40
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_LOG=megamoe=warn
new=$C/bin/megamoe; old=$C/old/megamoe; chmod +x $old
echo "elapsed ${SECONDS}s"; [ "$SECONDS" -gt 470 ] && { echo "no time left for the A/B"; exit 0; }
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
for w in new old; do b=$new; [ $w = old ] && b=$old
  echo "== AB flash $w"; timeout 120 $b bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1,64 --json $OUT/ab_flash_${w}.json 2>&1 | rows | grep whole
  echo "== AB v4-pro ep8 + whole $w"; timeout 150 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_${w}.json 2>&1 | rows | grep whole
done
echo "== env MEGAMOE_PREFETCH=65536 flash"; timeout 120 env MEGAMOE_PREFETCH=65536 $new bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1,64 --json $OUT/env_flash_pf64k.json 2>&1 | rows
if command -v ncu >/dev/null; then
  echo "== ncu router/plan new (flash whole T=1)"
  timeout 150 ncu --clock-control none -k "regex:moe_router|moe_plan" --launch-count 6 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
    $new bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 --iters 1 > $OUT/ncu_router_new.txt 2>&1
  grep -E "^  moe_|gpu__time" $OUT/ncu_router_new.txt | paste - - | awk '{print "  ", $1, $(NF)}' | head -8
fi
