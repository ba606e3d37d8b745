#!/usr/bin/env bash
# Stages the thirty-first session's unmeasured A/B (no device time was left for it) for one device
# call: "old" = this checkout, "mid" = + docs/results/tc-l2-pdl-2026-12-06-s31.patch (the mma.sync
# L2 as a programmatic dependent), "new" = mid + tc-bf16-one-chunk-stages-2026-12-06-s31.patch
# (4-deep one-chunk rings for bf16 decode tiles). Run HERE on a clean tree; it leaves both patches
# applied (new = the working tree). Then:
#   run(command="bash .device-carry/call2.sh", carry=[".device-carry", ".peers"], timeout_s=540)
# (SHORT=1 bash .device-carry/call2.sh: the A/B rows, verify, tests, fixtures, sanitizers — a small budget).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
git diff --quiet || { echo "stage.sh: the working tree has changes; commit or stash them first" >&2; exit 1; }
R=docs/results
S=/tmp/megamoe-s31
export CARGO_TARGET_DIR="$PWD/target"
rm -rf "$S" && mkdir -p "$S/kcache"
cargo build --release -p megamoe-cli && cp target/release/megamoe "$S/old"
git apply "$R/tc-l2-pdl-2026-12-06-s31.patch"
cargo build --release -p megamoe-cli && cp target/release/megamoe "$S/mid"
git apply "$R/tc-bf16-one-chunk-stages-2026-12-06-s31.patch"
# shellcheck disable=SC1091
source scripts/nvrtc_env.sh
# The kernels of mid and old into the seed (scripts/device.sh compiles new's and old's again from it).
for b in mid old; do
  MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_CACHE="$S/kcache" \
    "$S/$b" kernels --arch sm_90a >/dev/null
done
KCACHE_SEED="$S/kcache" KCACHE_TRIM=0 PRECOMPILE_PROBE=0 AB_OLD_BIN="$S/old" bash scripts/device.sh
mkdir -p .device-carry/mid && cp "$S/mid" .device-carry/mid/megamoe && strip --strip-debug .device-carry/mid/megamoe
cp "$R/s31-staged/call2.sh" .device-carry/
# Every staged build must find its kernels in the carried cache (a miss costs minutes of NVRTC there).
rm -rf "$S/check" && mkdir -p "$S/check" && tar -xJf .device-carry/kcache.tar.xz -C "$S/check"
for b in .device-carry/bin/megamoe .device-carry/mid/megamoe .device-carry/old/megamoe; do
  MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1 MEGAMOE_CACHE="$S/check/kcache" \
    "$b" kernels --arch sm_90a >/dev/null
done
tar -cJf .device-carry/kcache.tar.xz -C "$S/check" kcache
du -sh .device-carry
