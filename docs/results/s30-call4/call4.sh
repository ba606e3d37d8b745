#!/usr/bin/env bash
# Session 30, call 4: the fused decode kernel beside the shared expert (MEGAMOE_FUSED_OVERLAP=1/2/3
# CTAs per SM) against the separate stages beside it (default) and 26f1b68's serial rank+shared;
# the host-model tests under the knob first.
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
data="$PWD/crates/megamoe/tests/data"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_LOG=megamoe=warn
export MEGAMOE_TEST_DATA="$data" MEGAMOE_REQUIRE_GPU=1
mkdir -p "$MEGAMOE_CACHE" && tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
chmod +x $C/bin/* $C/old/*
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== tests under MEGAMOE_FUSED_OVERLAP=2"
MEGAMOE_FUSED_OVERLAP=2 timeout 150 $C/bin/cuda_engine --test-threads 1 nvfp4_all_modes hash_layer repeat_runs nan_rows external_routing 2>&1 | grep -E "^test |test result" | head -20
echo "== verify + fixtures under MEGAMOE_FUSED_OVERLAP=2"
MEGAMOE_FUSED_OVERLAP=2 timeout 120 $C/bin/megamoe verify --backend cuda 2>&1 | grep -E "verify:|FAIL" | head -5
MEGAMOE_FUSED_OVERLAP=2 timeout 60 $C/bin/cuda_fixtures --test-threads 1 2>&1 | grep -E "test result"
echo "== tests, default"
timeout 100 $C/bin/cuda_engine --test-threads 1 shared_expert_forked repeat_runs 2>&1 | grep -E "test result"
new=$C/bin/megamoe; old=$C/old/megamoe
rows() { grep -E "^v4-" | awk '{printf "  %-8s %-12s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
for cfg in MEGAMOE_FUSED_OVERLAP= MEGAMOE_FUSED_OVERLAP=2 MEGAMOE_FUSED_OVERLAP=3; do
  tag=${cfg//[^A-Za-z0-9]/}
  echo "== $cfg v4-pro ep8 + whole"; timeout 150 env $cfg $new bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer --tokens 1,8,64 --json $OUT/pro_$tag.json 2>&1 | rows
  echo "== $cfg flash"; timeout 120 env $cfg $new bench forward --backend cuda --shape v4-flash --whole-layer --tokens 1,64 --json $OUT/flash_$tag.json 2>&1 | rows
  [ "$SECONDS" -gt 330 ] && { echo "time"; break; }
done
echo "== old (serial rank+shared) v4-pro ep8"; timeout 100 $old bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 1,8,64 --json $OUT/pro_old.json 2>&1 | rows
