#!/usr/bin/env bash
# Run HERE (no GPU needed): builds the release `megamoe` binary and the CUDA test executables,
# stages them with scripts/device/run.sh into .device-carry/ (git-ignored), and prints
# the device `run` call to make. The companion script runs THERE, on the GPU machine.
# Usage: bash scripts/device.sh   (env CARRY_DIR: where to stage, default .device-carry; KCACHE_SEED:
# an unpacked earlier kernel cache; AB_OLD_BIN: an earlier `megamoe` to stage beside this one)
set -euo pipefail
cd "$(dirname "$0")/.."
carry="${CARRY_DIR:-$PWD/.device-carry}"
# This checkout's own target dir: several checkouts sharing one would overwrite each other's
# target/release/megamoe, and a stale binary would be staged.
export CARGO_TARGET_DIR="$PWD/target"
cargo build --release -p megamoe-cli
targets=""
for f in crates/megamoe/tests/cuda_*.rs; do n=$(basename "$f" .rs); [ "$n" != cuda_compile ] && targets="$targets --test $n"; done
# shellcheck disable=SC2086
tests=$(cargo test --release -p megamoe --no-run $targets --message-format=json \
  | python3 -c 'import sys,json
for l in sys.stdin:
    try: m=json.loads(l)
    except Exception: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["target"]["name"], m["executable"])')
rm -rf "$carry" && mkdir -p "$carry/bin"
cp "$CARGO_TARGET_DIR/release/megamoe" "$carry/bin/"
# AB_OLD_BIN: an earlier build's `megamoe`, staged as old/megamoe for run.sh's AB_OLD comparison.
if [ -n "${AB_OLD_BIN:-}" ]; then mkdir -p "$carry/old" && cp "$AB_OLD_BIN" "$carry/old/megamoe"; fi
# AB_MORE_BINS: "name=path ..": more builds' `megamoe`, staged as name/megamoe (a three-way A/B).
for nb in ${AB_MORE_BINS:-}; do mkdir -p "$carry/${nb%%=*}" && cp "${nb#*=}" "$carry/${nb%%=*}/megamoe"; done
more_bins=""; for nb in ${AB_MORE_BINS:-}; do more_bins="$more_bins $carry/${nb%%=*}/megamoe"; done
while read -r name exe; do [ -n "$name" ] && cp "$exe" "$carry/bin/$name"; done <<<"$tests"
strip --strip-debug "$carry"/bin/* ${AB_OLD_BIN:+"$carry"/old/*} $more_bins 2>/dev/null || true
# The kernels, compiled here for sm_90a into the cache the device run loads them from (keyed by the
# source, the options and the NVRTC version: both sides use NVRTC 13.0, the include path below and
# ptxas' verbose report), so a fresh device machine spends no time in NVRTC. PRECOMPILE=0 skips it.
if [ "${PRECOMPILE:-1}" != 0 ] && [ -f scripts/nvrtc_env.sh ]; then
  # shellcheck disable=SC1091
  source scripts/nvrtc_env.sh
  # KCACHE_SEED: a directory of earlier cache entries (an unpacked kcache.tar.xz): only the modules
  # whose source changed since are compiled again (the stale entries travel too, unused).
  if [ -n "${KCACHE_SEED:-}" ]; then mkdir -p "$carry/kcache" && cp "$KCACHE_SEED"/* "$carry/kcache/"; fi
  # Every staged build's kernels (this one's, and AB_OLD_BIN's for run.sh AB_OLD), and the
  # phase-probe build of the FP4 / bf16 tensor-core modules and the chained L1 + L2 module, which a
  # probe run loads too (run.sh PHASE_PROBE=1; left out, the device compiled it in the run).
  precompile() {
    for b in "$carry/bin/megamoe" ${AB_OLD_BIN:+"$carry/old/megamoe"} $more_bins; do
      MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_CACHE="$carry/kcache" \
        "$b" kernels --arch sm_90a >/dev/null || echo "warning: precompiling the kernels of $b failed" >&2
      # PRECOMPILE_ENVS: "VAR=VALUE[,VAR=VALUE..] ..." — each a knob setting whose modules a run
      # loads too (e.g. MEGAMOE_WG_CHAIN=1: the chained L1 + L2 module everywhere; modules the
      # setting leaves alone are cache hits).
      for e in ${PRECOMPILE_ENVS:-}; do
        # shellcheck disable=SC2046
        env $(tr ',' ' ' <<<"$e") MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_CACHE="$carry/kcache" \
          "$b" kernels --arch sm_90a >/dev/null || echo "warning: precompiling under $e failed" >&2
      done
      if [ "${PRECOMPILE_PROBE:-1}" != 0 ]; then
        for m in gemm_tc-nvfp4 gemm_tc-bf16 gemm_tc_l1l2-nvfp4; do
          MEGAMOE_PHASE_PROBE=1 MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_CACHE="$carry/kcache" \
            "$b" kernels --arch sm_90a --filter "$m" >/dev/null || echo "warning: precompiling the probe build failed" >&2
        done
      fi
    done
  }
  precompile
  # A seeded cache carries every earlier build's entries: keep only those the staged builds read
  # (their access times, set back first; all hits now, so this pass compiles nothing). Where the
  # file system does not record reads, everything stays.
  if [ -n "${KCACHE_SEED:-}" ] && [ "${KCACHE_TRIM:-1}" != 0 ]; then
    find "$carry/kcache" -type f -exec touch -a -d '2000-01-01' {} +
    precompile
    if [ -n "$(find "$carry/kcache" -type f -newerat '2001-01-01' -print -quit)" ]; then
      find "$carry/kcache" -type f ! -newerat '2001-01-01' -delete
    fi
  fi
  # Compressed: the device tool carries at most 64 MiB with the working tree.
  [ -d "$carry/kcache" ] && tar -cJf "$carry/kcache.tar.xz" -C "$carry" kcache && rm -rf "$carry/kcache"
fi
cp scripts/device/run.sh "$carry/run.sh"
cp scripts/device/fp8_rate.py scripts/device/ab_table.py "$carry/"
cp scripts/device/call_env.sh "$carry/call_env.sh"
cp scripts/device/slice_ab.sh scripts/device/default_check.sh scripts/device/ab_gate.sh "$carry/"
# (The golden fixtures travel with the working tree: run.sh reads crates/megamoe/tests/data.)
# The peers (torch baselines, triton_kernels' MXFP4 MoE) travel beside the binaries when present.
if [ -d ../shared/peers ]; then rm -rf .peers && cp -r ../shared/peers .peers; fi
du -sh "$carry" .peers 2>/dev/null || true   # (.peers is absent without ../shared/peers)
cat <<MSG
Staged in $carry. Now call the device tool:
  run(command="bash .device-carry/run.sh", carry=[".device-carry", ".peers"], timeout_s=600)
(env: BENCH=1 for the EP-rank bench, PEERS=1 for the peers, SKIP_VERIFY=1, SANITIZE=0, NCU=0)
MSG
