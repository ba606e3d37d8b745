#!/usr/bin/env bash
# Session 30, call 2: the router's batched loads + PDL chain (router -> topk -> plan) against the
# build before (AB: whole-layer rows), env sweeps (shared overlap early, shared on the streaming
# kernels, larger L2 prefetch), ncu of the router / plan kernels, an nsys timeline of V4-Flash T=1.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export TEST_FILTER="router hash_layer nan_rows repeat_runs shared_expert_forked tiny_plan large_batch external_routing" TEST_TIMEOUT=240
export SANITIZE=0 INITCHECK=0 TIMINGS=0 NCU=0 EP_TEST_FILTER=zzz_none SKIP_DEMO=1 BENCH=0
bash $C/run.sh > "$OUT/run_stdout.txt" 2>&1
sed -n '/SUMMARY/,$p' "$OUT/run_stdout.txt" | grep -vE "INFO|^\s*$" | head -40
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_LOG=megamoe=warn
new=$C/bin/megamoe; old=$C/old/megamoe; chmod +x $old
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
for r in 1 2; do for w in new old; do b=$new; [ $w = old ] && b=$old
  echo "== AB flash $w r$r"; timeout 120 $b bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1,64 --json $OUT/ab_flash_${w}_r$r.json 2>&1 | rows
done; done
for w in new old; do b=$new; [ $w = old ] && b=$old
  echo "== AB v4-pro ep8 + whole $w"; timeout 150 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_${w}.json 2>&1 | rows
done
for cfg in MEGAMOE_OVERLAP=early MEGAMOE_STREAM=1 MEGAMOE_OVERLAP=0; do
  echo "== env $cfg flash"; timeout 120 env $cfg $new bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1,64 --json $OUT/env_flash_${cfg//[^A-Za-z0-9]/}.json 2>&1 | rows
done
for cfg in MEGAMOE_PREFETCH=32768 MEGAMOE_PREFETCH=65536 MEGAMOE_PREFETCH=131072 MEGAMOE_STREAM=1; do
  echo "== env $cfg pro rank"; timeout 120 env $cfg $new bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1,8,64 --json $OUT/env_pro_${cfg//[^A-Za-z0-9]/}.json 2>&1 | rows
done
if command -v ncu >/dev/null; then for w in new old; do b=$new; [ $w = old ] && b=$old
  echo "== ncu router/plan $w (flash whole T=1)"
  timeout 150 ncu --clock-control none -k "regex:moe_router|moe_plan" --launch-count 9 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
    $b bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 --iters 1 > $OUT/ncu_router_$w.txt 2>&1
  grep -E "^  moe_|gpu__time" $OUT/ncu_router_$w.txt | paste - - | awk '{print "  ", $1, $(NF)}' | head -12
done; fi
if command -v nsys >/dev/null; then
  echo "== nsys flash whole T=1 (new)"
  timeout 150 nsys profile --cuda-graph-trace=node -o $OUT/flash1 --force-overwrite true \
    $new bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 --iters 3 > $OUT/nsys_run.txt 2>&1
  nsys stats -r cuda_gpu_trace -f csv -o $OUT/flash1 $OUT/flash1.nsys-rep > /dev/null 2>&1
  ls $OUT | grep -i flash1
  f=$(ls $OUT/flash1*gpu_trace*.csv 2>/dev/null | head -1); [ -n "$f" ] && tail -n 24 "$f" | cut -c1-220
  rm -f $OUT/flash1.sqlite
else echo "no nsys"; fi
