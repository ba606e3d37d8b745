#!/usr/bin/env bash
# The fortieth session's third device call: three builds alternated twice — "new" (the lean wgmma
# L1 and L2 epilogues: wg_store_l1 / wg_store_l2), "fast" (new + a SwiGLU on __expf / __fdividef,
# a candidate only: its source is docs/results/s40-call3/README.md's) and "old" (999dd2c) — then the
# checks of new (and verify of fast) and the wgmma stall samples of new. Staged here by
#   KCACHE_SEED=<unpacked cache> PRECOMPILE_PROBE=0 AB_OLD_BIN=<999dd2c's megamoe> bash scripts/device.sh
# + fast/megamoe with its kernels precompiled into the carried cache, this script copied in;
# run(command="bash .device-carry/call3.sh", carry=[".device-carry", ".peers"], timeout_s=600).
set -uo pipefail
A=/tmp/s40c3/all; mkdir -p "$A"; O0="$OUT"
OUT=$A source .device-carry/call_env.sh
pack() { pack_to "$A" "$O0"; }
pack_every "$A" "$O0"
chmod +x $C/fast/megamoe
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $A/gpu.txt
bin_of() { case $1 in new) echo $C/bin/megamoe;; fast) echo $C/fast/megamoe;; old) echo $C/old/megamoe;; esac; }
for r in 1 2; do
  for w in new fast old; do
    b=$(bin_of $w)
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
    o = sorted(d.get(k + ("old",), [0]))[0]
    print(k, " ".join("%s %s (%+.2f%%)" % (w, ["%.4f" % v for v in d.get(k + (w,), [])],
          100 * (sorted(d.get(k + (w,), [o]))[0] - o) / o if o else 0) for w in ("new", "fast", "old")))
PY
echo "== ab ${SECONDS}s"; pack
for i in 1 2; do for w in new fast old; do
  timeout 60 ncu --clock-control none -k regex:moe_wg -c 2 --metrics gpu__time_duration.sum $(bin_of $w) bench forward \
    --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 | grep -E "moe_wg|gpu__time" | paste - - \
    | awk -v w=$w '{print w, $1, $NF}' | tee -a $A/ncu_times.txt
done; done
echo "== ncu times ${SECONDS}s"; pack
timeout 150 $C/bin/cuda_engine --test-threads=1 prefill_three_consumer prefill_chained prefill_two_group prefill_fitted \
  routed_forward_folds repeat_runs shared_expert_forked slice_ fused_decode > $A/engine_tests.txt 2>&1
grep -E "^test |panicked|test result" $A/engine_tests.txt | head -14; pack
timeout 60 compute-sanitizer --tool memcheck --print-limit 5 $C/bin/cuda_engine --test-threads=1 prefill_three_consumer \
  > $A/memcheck.txt 2>&1; grep -E "ERROR SUMMARY|test result" $A/memcheck.txt | head -2
timeout 100 $C/bin/megamoe verify --backend cuda > $A/verify_new.txt 2>&1; grep -E "verify:|FAIL" $A/verify_new.txt | head -3
timeout 100 $C/bin/cuda_fixtures --test-threads 1 > $A/fixtures.txt 2>&1; grep -E "test result|panicked" $A/fixtures.txt
timeout 100 $C/fast/megamoe verify --backend cuda > $A/verify_fast.txt 2>&1; grep -E "verify:|FAIL" $A/verify_fast.txt | head -3
echo "== checks ${SECONDS}s"; pack
OUT=$A/ncu SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 NCU_DETAIL=1 \
  NCU_DETAIL_SPECS="wg:regex:moe_wg_l:4096:2" timeout 150 bash .device-carry/run.sh > $A/ncu.txt 2>&1
tail -2 $A/ncu.txt; echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack
