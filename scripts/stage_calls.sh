#!/usr/bin/env bash
# Run HERE (no GPU needed): stages a results folder's device calls in one go — this checkout's build
# and kernels (scripts/device.sh), an earlier revision's `megamoe` as the A/B "old" build (BASE=<rev>:
# built in a git worktree with its own target directory), the ramp probe (scripts/build_probe.sh;
# PROBE=0 skips it) and the folder's call*.sh scripts — into .device-carry/, then checks the carry
# against the device tool's 64 MiB (working tree included).
# Usage: BASE=9a83107 [MID=<rev>] bash scripts/stage_calls.sh docs/results/s41-call1
# Then: run(command="bash .device-carry/call1.sh", carry=[".device-carry", ".peers"], timeout_s=600).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: BASE=<rev> bash scripts/stage_calls.sh docs/results/<folder>}"
# The `megamoe` of revision $1, built in a git worktree with its own target directory (its path).
build_rev() {
  local wt="/tmp/megamoe-base-$1"
  [ -d "$wt" ] || git worktree add -f "$wt" "$1" >/dev/null
  (cd "$wt" && CARGO_TARGET_DIR="/tmp/megamoe-base-target-$1" cargo build --release -p megamoe-cli) >&2
  echo "/tmp/megamoe-base-target-$1/release/megamoe"
}
old=""; [ -z "${BASE:-}" ] || old="$(build_rev "$BASE")"
# MID=<rev>: one more earlier build, staged as mid/megamoe (a three-way A/B: old, mid, this one).
more=""; [ -z "${MID:-}" ] || more="mid=$(build_rev "$MID")"
PRECOMPILE_PROBE="${PRECOMPILE_PROBE:-0}" AB_OLD_BIN="$old" AB_MORE_BINS="$more" bash scripts/device.sh
cp "$dir"/call*.sh .device-carry/
if [ "${PROBE:-1}" != 0 ]; then
  bash scripts/build_probe.sh scripts/device/ramp_probe.cu .device-carry/ramp_probe
  strip --strip-all .device-carry/ramp_probe 2>/dev/null || true
fi
tree_kb=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
carry_kb=$(du -sk .device-carry .peers 2>/dev/null | awk '{s += $1} END {print s}')
echo "carry: $((carry_kb / 1024)) MiB + working tree $((tree_kb / 1024)) MiB (the device tool takes 64 MiB in all)"
if [ $((carry_kb + tree_kb)) -gt $((64 * 1024)) ]; then
  echo "warning: over 64 MiB; drop .device-carry/old or strip the binaries (strip --strip-all)" >&2
fi
