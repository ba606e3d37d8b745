#!/usr/bin/env bash
# The forty-first session's fourth staged call (same staging as call1.sh): the final build's bench
# with both peers in the same run (run.sh BENCH=1 PEERS=1: the EP-rank and whole-layer rows, the
# peers' own routing draw, the roofline plot) — the standing figures of issues 9 and 10 — and the
# ramp probe (a decode step's bytes read once from a cold L2: the practical floor, never measured on
# an H200; its binary from `bash scripts/build_probe.sh scripts/device/ramp_probe.cu
# .device-carry/ramp_probe`, stripped, after scripts/device.sh).
# run(command="bash .device-carry/call4.sh", carry=[".device-carry", ".peers"], timeout_s=420).
set -uo pipefail
CALL=s41c4 source .device-carry/call_env.sh
cat $A/gpu.txt
OUT=$A/bench SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 BENCH=1 PEERS=1 RAMP_PROBE=1 \
  timeout 380 bash .device-carry/run.sh > $A/bench.txt 2>&1
grep -E "^v4-" $A/bench.txt | awk '{print $1, $6, $7, $10, $15}' | head -40
call_end
