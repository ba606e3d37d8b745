#!/usr/bin/env bash
# Stages call 5 (run HERE, no GPU; from a clean tree, also a fresh checkout; ~5-10 min on 2 cores):
# "v2" = the thirty-second session's slice kernel (8fd1e18) built in a worktree and staged as
# old/megamoe, then this tree through scripts/device.sh (kernels precompiled for both, the cache
# trimmed to what they read). Then:
#   run(command="bash .device-carry/call5.sh", carry=[".device-carry", ".peers"], timeout_s=480)
# (ROUNDS=1 SWEEP=0 NCU_T=1 RACE=0 in front of it for a small budget.)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
root="$PWD"
S=/tmp/megamoe-s33
rm -rf "$S" && mkdir -p "$S"
git worktree remove --force "$S/v2" 2>/dev/null || true
git worktree add --detach "$S/v2" 8fd1e18
# shellcheck disable=SC1091
source scripts/nvrtc_env.sh
# The same target dir as device.sh (only the megamoe crates rebuild between the two trees).
(cd "$S/v2" && CARGO_TARGET_DIR="$root/target" cargo build --release -p megamoe-cli)
cp target/release/megamoe "$S/v2.bin"
git worktree remove --force "$S/v2"
# Cargo's fingerprints of path crates are mtimes checked against the last build, and the worktree's
# build was the last: without this, device.sh's build of this tree finds it "fresh" and stages v2.
find crates -type f \( -name '*.rs' -o -name '*.cu' -o -name '*.cuh' \) -exec touch {} +
seed=""
if [ -f .device-carry/kcache.tar.xz ]; then tar -xJf .device-carry/kcache.tar.xz -C "$S" && seed="$S/kcache"; fi
KCACHE_SEED="$seed" PRECOMPILE_PROBE=0 AB_OLD_BIN="$S/v2.bin" bash scripts/device.sh
# call5 needs megamoe and cuda_engine, and cuda_fixtures for a fixtures run on the slice path (fully
# stripped: 4 MB); cuda_ep stays here (64 MiB carry limit).
rm -f .device-carry/bin/cuda_ep
strip .device-carry/bin/cuda_fixtures 2>/dev/null || true
cp docs/results/s33-staged/call5.sh .device-carry/
du -sh .device-carry
cmp -s .device-carry/bin/megamoe .device-carry/old/megamoe && { echo "error: this build and v2 staged the same binary" >&2; exit 1; }
grep -qa MEGAMOE_SLICE_CLUSTERS .device-carry/bin/megamoe || { echo "error: the staged build lacks this tree's knob" >&2; exit 1; }
echo staged
