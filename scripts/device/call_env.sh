#!/usr/bin/env bash
# Sourced THERE by a staged call script (docs/results/*-staged/call*.sh) from the repository root:
# $OUT, the CUDA library path, the kernel cache unpacked from the carry (so no module is compiled
# on the device), the golden fixtures, and C = the carry folder.
# CALL=<name>: the call's logs go to A=/tmp/<name>/all, which travels back as $OUT/all.tgz — packed
# every 15 s and by `pack` —; the GPU's name and clocks in $A/gpu.txt; `call_end` at the script's end.
if [ -n "${CALL:-}" ]; then
  O0="${OUT:-/tmp/megamoe-out}"; mkdir -p "$O0"
  A=/tmp/$CALL/all; mkdir -p "$A"; OUT=$A
fi
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
C=.device-carry
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MEGAMOE_CACHE=/tmp/megamoe-kernels MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
export MEGAMOE_TEST_DATA="$PWD/crates/megamoe/tests/data" MEGAMOE_REQUIRE_GPU=1
mkdir -p "$MEGAMOE_CACHE"
if [ -f $C/kcache.tar.xz ]; then tar -xJf $C/kcache.tar.xz -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/; fi
chmod +x $C/bin/* 2>/dev/null
[ -d $C/old ] && chmod +x $C/old/*
nvidia-smi --query-gpu=name --format=csv,noheader
# A bench table's rows, one line each: shape, what, T, median ms, x floor (the staged calls' A/B logs).
bench_rows() { grep -E "^v4-" | awk '{printf "  %-8s %-14s T=%-6s %s ms ratio %s\n", $1, $6, $7, $10, $15}'; }
# Packs folder $1 (its parent and name) into $2/all.tgz now, and with `pack_every` every 15 s in the
# background (the device tool returns 8 files: every log travels in one archive).
pack_to() { tar -czf "$2/all.tmp.tgz" -C "$(dirname "$1")" "$(basename "$1")" 2>/dev/null && mv "$2/all.tmp.tgz" "$2/all.tgz"; }
pack_every() { ( while sleep 15; do pack_to "$1" "$2"; done ) & }
if [ -n "${CALL:-}" ]; then
  pack() { pack_to "$A" "$O0"; }
  call_end() { echo "== all done ${SECONDS}s"; pack; kill %1 2>/dev/null; pack; }
  pack_every "$A" "$O0"
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader > "$A/gpu.txt"
fi
