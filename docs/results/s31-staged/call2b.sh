#!/usr/bin/env bash
# Session 31, call 2 (short form, little device budget left): the mma.sync GEMMs' L2 as a
# programmatic dependent ("mid"), plus one-chunk bf16 stages ("new"), against call 1's build ("old"):
# decode / whole-layer rows alternated; then verify (new, mid), tests, fixtures, memcheck / racecheck.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1 MEGAMOE_LOG=megamoe=warn
mkdir -p "$MEGAMOE_CACHE" && tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
chmod +x $C/bin/* $C/old/megamoe $C/mid/megamoe
nvidia-smi --query-gpu=name --format=csv,noheader
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms (min %s) ratio %s\n", $1, $6, $7, $10, $11, $15}'; }
for r in 1 2; do
  for w in new mid old; do
    b=$C/bin/megamoe; [ $w != new ] && b=$C/$w/megamoe
    echo "== round $r $w pro" | tee -a $OUT/ab.txt; timeout 60 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8 --json $OUT/ab_pro_${w}_$r.json 2>&1 | rows | grep -v " rank " | tee -a $OUT/ab.txt
    echo "== round $r $w flash" | tee -a $OUT/ab.txt; timeout 40 $b bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1 --json $OUT/ab_flash_${w}_$r.json 2>&1 | rows | grep -v " rank " | tee -a $OUT/ab.txt
  done
done
echo "elapsed ${SECONDS}s"
for w in new mid; do b=$C/bin/megamoe; [ $w != new ] && b=$C/$w/megamoe
  echo "== verify $w"; timeout 60 $b verify --backend cuda > $OUT/verify_$w.txt 2>&1; grep -E "verify:|FAIL|backend under" $OUT/verify_$w.txt | head -5; done
echo "== tests new"; timeout 120 $C/bin/cuda_engine --test-threads 1 shared_expert_forked repeat_runs external_routing w4a8_fp8 decode_split nan_rows nvfp4_all_modes trace_records > $OUT/tests.txt 2>&1; grep -E "^test |test result" $OUT/tests.txt | tail -12
echo "== fixtures new"; timeout 60 $C/bin/cuda_fixtures --test-threads 1 2>&1 | grep -E "test result"
echo "elapsed ${SECONDS}s"
[ "$SECONDS" -lt 130 ] && for tool in memcheck racecheck; do echo "== $tool"; timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $C/bin/cuda_engine --test-threads 1 shared_expert_forked external_routing > $OUT/$tool.txt 2>&1; echo "rc=$? $(grep -E 'ERROR SUMMARY|test result' $OUT/$tool.txt | tr '\n' ' ')"; done
echo "elapsed ${SECONDS}s"
