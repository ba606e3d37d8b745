#!/usr/bin/env bash
# The fortieth session's first device call: the lean wgmma L2 epilogue (wg_store_l2) against the
# standing build (999dd2c) alternated, then the checks of the new build, the bench with both peers,
# the ramp probe and the wgmma stall samples. Staged here by
#   KCACHE_SEED=<unpacked last kcache> PRECOMPILE_PROBE=0 AB_OLD_BIN=<999dd2c's megamoe> bash scripts/device.sh
# + this script and scripts/build_probe.sh's ramp_probe copied into .device-carry/;
# run(command="bash .device-carry/call1.sh", carry=[".device-carry", ".peers"], timeout_s=600).
# One archive, $OUT/all.tgz, refreshed every 15 s.
set -uo pipefail
A=/tmp/s40c/all; mkdir -p "$A"; O0="$OUT"
OUT=$A source .device-carry/call_env.sh   # the kernel cache, MEGAMOE_* paths, C, pack_to / pack_every
pack() { pack_to "$A" "$O0"; }
pack_every "$A" "$O0"
B=$C/bin/megamoe; OLD=$C/old/megamoe
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
# 1. A/B: new (this build) and old alternated twice, V4-Pro EP8 rank (rank and rank + shared rows)
#    and V4-Flash (routed and + shared), prefill T.
for r in 1 2; do
  for w in new old; do
    b=$B; [ $w = old ] && b=$OLD
    MEGAMOE_LOG=megamoe=warn timeout 90 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 512,4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 - $A <<'PY' | tee $A/ab_table.txt
import json, sys, glob, collections
d = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/ab_*_r*.json")):
    w = f.rsplit("/", 1)[1].split("_")[1]
    for r in json.load(open(f))["rows"]:
        d[(r["shape"], r.get("kind", "?"), r["T"], w)].append(r["median_ms"])
for k in sorted({k[:3] for k in d}):
    n, o = d.get(k + ("new",), []), d.get(k + ("old",), [])
    print(k, "new", n, "old", o, "" if not (n and o) else "%+.2f%%" % (100 * (sorted(n)[0] - sorted(o)[0]) / sorted(o)[0]))
PY
echo "== ab ${SECONDS}s"; pack
# 2. Per-kernel times of both builds at T=4096 (one forward each, serialised by ncu).
for w in new old; do
  b=$B; [ $w = old ] && b=$OLD
  timeout 90 ncu --clock-control none -k regex:moe_ --launch-count 12 --metrics gpu__time_duration.sum \
    $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 > $A/ncu_time_$w.txt 2>&1
  grep -E "moe_|gpu__time" $A/ncu_time_$w.txt | paste - - | awk '{print $1, $(NF)}' | head -14
done
echo "== ncu times ${SECONDS}s"; pack
# 3. Checks of the new build: the wgmma prefill tests (three consumers, chained, two-group: MB = 1
#    and 2), the fold, repeat runs, the slice / fused decode tests; verify; fixtures.
timeout 240 $C/bin/cuda_engine --test-threads=1 prefill_three_consumer prefill_chained prefill_two_group \
  routed_forward_folds repeat_runs slice_ fused_decode > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -12; pack
timeout 100 $B verify --backend cuda > $A/verify.txt 2>&1; grep -E "verify:|FAIL" $A/verify.txt | head -3
timeout 100 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
echo "== checks ${SECONDS}s"; pack
# 4. The bench with both peers in the same run (EP-rank, whole-layer, V4-Flash rows, peers, same routing).
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 \
  timeout 200 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-|rank|peer" $A/bench.txt | tail -30 | cut -c1-180; echo "== bench ${SECONDS}s"; pack
# 5. The ramp probe on this GPU (practical floor of a decode step's bytes).
chmod +x .device-carry/ramp_probe 2>/dev/null
timeout 60 .device-carry/ramp_probe > $A/ramp_probe.txt 2>&1; head -24 $A/ramp_probe.txt
echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
