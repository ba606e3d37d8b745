#!/usr/bin/env bash
# Stages the thirty-second session's call: "old" = HEAD before the session (0e2a5d0), "mid" = + the
# mma.sync L2 as a programmatic dependent (docs/results/tc-l2-pdl-2026-12-06-s31.patch), "new" =
# this working tree (mid + bf16 one-chunk stages + the slice-parallel decode kernel, opt-in
# MEGAMOE_SLICE=1). Needs old/mid staged by docs/results/s31-staged/stage.sh in .device-carry
# (their kernels in its kcache). Then:
#   run(command="bash .device-carry/call3.sh", carry=[".device-carry", ".peers"], timeout_s=560)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
S=/tmp/megamoe-s32
rm -rf "$S" && mkdir -p "$S"
cp .device-carry/old/megamoe "$S/old" && cp .device-carry/mid/megamoe "$S/mid"
tar -xJf .device-carry/kcache.tar.xz -C "$S"
KCACHE_SEED="$S/kcache" KCACHE_TRIM=0 PRECOMPILE_PROBE=0 AB_OLD_BIN="$S/old" bash scripts/device.sh
mkdir -p .device-carry/mid && cp "$S/mid" .device-carry/mid/megamoe
cp docs/results/s32-staged/call3.sh .device-carry/
# Every staged build must find its kernels in the carried cache (a miss costs minutes of NVRTC there).
# shellcheck disable=SC1091
source scripts/nvrtc_env.sh
rm -rf "$S/check" && mkdir -p "$S/check" && tar -xJf .device-carry/kcache.tar.xz -C "$S/check"
for b in .device-carry/bin/megamoe .device-carry/mid/megamoe .device-carry/old/megamoe; do
  MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_CACHE="$S/check/kcache" \
    "$b" kernels --arch sm_90a | grep -vc cached | sed "s|^|$b: modules compiled (want 0 + header): |"
done
tar -cJf .device-carry/kcache.tar.xz -C "$S/check" kcache
du -sh .device-carry
