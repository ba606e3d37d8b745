#!/usr/bin/env bash
# Stages call 4: "new" = this working tree (the slice-parallel decode kernel, opt-in MEGAMOE_SLICE=1)
# and, where .device-carry/old/megamoe exists (an earlier build staged there), that build as "old".
# Works from a fresh checkout (no old build: call4.sh then compares slice and base only). Then:
#   run(command="bash .device-carry/call4.sh", carry=[".device-carry", ".peers"], timeout_s=400)
# (ROUNDS=1 FLASH=0 NCU=0 VERIFY=0 in front of it for a small budget.)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
S=/tmp/megamoe-s32b
rm -rf "$S" && mkdir -p "$S"
old=""
if [ -f .device-carry/old/megamoe ]; then cp .device-carry/old/megamoe "$S/old" && old="$S/old"; fi
seed=""
if [ -f .device-carry/kcache.tar.xz ]; then tar -xJf .device-carry/kcache.tar.xz -C "$S" && seed="$S/kcache"; fi
KCACHE_SEED="$seed" KCACHE_TRIM=0 PRECOMPILE_PROBE=0 AB_OLD_BIN="$old" bash scripts/device.sh
cp docs/results/s32-staged/call4.sh .device-carry/
# shellcheck disable=SC1091
source scripts/nvrtc_env.sh
rm -rf "$S/check" && mkdir -p "$S/check" && tar -xJf .device-carry/kcache.tar.xz -C "$S/check"
for b in .device-carry/bin/megamoe ${old:+.device-carry/old/megamoe}; do
  MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_CACHE="$S/check/kcache" \
    "$b" kernels --arch sm_90a | grep "^==" | grep -vc cached | sed "s|^|$b: modules compiled here (want 0): |" || true
done
tar -cJf .device-carry/kcache.tar.xz -C "$S/check" kcache
du -sh .device-carry
