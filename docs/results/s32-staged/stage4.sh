#!/usr/bin/env bash
# Stages call 4: "old" = HEAD before the session (0e2a5d0; staged in .device-carry/old by stage.sh),
# "new" = this working tree (the slice-parallel decode kernel, opt-in MEGAMOE_SLICE=1; the other
# kernels as old's). Then:
#   run(command="bash .device-carry/call4.sh", carry=[".device-carry", ".peers"], timeout_s=400)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
S=/tmp/megamoe-s32b
rm -rf "$S" && mkdir -p "$S"
cp .device-carry/old/megamoe "$S/old"
tar -xJf .device-carry/kcache.tar.xz -C "$S"
KCACHE_SEED="$S/kcache" KCACHE_TRIM=0 PRECOMPILE_PROBE=0 AB_OLD_BIN="$S/old" bash scripts/device.sh
cp docs/results/s32-staged/call4.sh .device-carry/
# shellcheck disable=SC1091
source scripts/nvrtc_env.sh
rm -rf "$S/check" && mkdir -p "$S/check" && tar -xJf .device-carry/kcache.tar.xz -C "$S/check"
for b in .device-carry/bin/megamoe .device-carry/old/megamoe; do
  MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_CACHE="$S/check/kcache" \
    "$b" kernels --arch sm_90a | grep "^==" | grep -vc cached | sed "s|^|$b: modules compiled here (want 0): |" || true
done
tar -cJf .device-carry/kcache.tar.xz -C "$S/check" kcache
du -sh .device-carry
