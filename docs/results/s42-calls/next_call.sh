#!/usr/bin/env bash
# Staged for the next session (not run): the 80-token FP8 L2 (ace0a1a, never run: its test first),
# where the wgmma L1 at T=4096 waits, and the rank + shared T=16384 regression of the narrower widths. Stage: `BASE=d5bf9f4 PROBE=0 bash scripts/stage_calls.sh
# docs/results/s42-calls` (this build as "new", the forty-first session's as "old"), then
# run(command="bash .device-carry/next_call.sh", carry=[".device-carry", ".peers"]). ~550 s.
set -uo pipefail
CALL=s43c1 source .device-carry/call_env.sh
cat $A/gpu.txt
bin_of() { case $1 in new) echo $C/bin/megamoe;; old) echo $C/old/megamoe;; esac; }
# 0. The W4A8 FP8 test (both settings; `l2` now runs the 80-token FP8 L2 on its E64 T640 layer), then
#    W4A8 on MXFP4: the bf16 path / FP8 L2 only / both FP8, this build, V4-Pro rank T=4096,16384.
timeout 150 $C/bin/cuda_engine --test-threads=1 --nocapture w4a8_fp8_prefill > $A/w4a8_test.txt 2>&1
grep -E "rel L2|^test |panicked|test result" $A/w4a8_test.txt | head -14; pack
for w in l2 both bf16; do
  f=0; [ $w = l2 ] && f=l2; [ $w = both ] && f=1
  MEGAMOE_W4A8_FP8=$f MEGAMOE_LOG=megamoe=warn timeout 80 $C/bin/megamoe bench forward --backend cuda --shape v4-pro \
    --simulate-ep 8 --format mxfp4 --mode w4a8 --tokens 4096,16384 --json $A/ab_w8${w}_pro_r1.json > $A/ab_w8${w}_pro_r1.txt 2>&1
done
python3 .device-carry/ab_table.py $A w8l2 w8both w8bf16 | tee $A/ab_w4a8.txt; pack
# 1. The rank + shared T=16384 row with the shared expert beside the routed experts (default) and
#    after them (MEGAMOE_OVERLAP=0), both builds, twice: is the +2% the two streams' overlap?
for r in 1 2; do
  for w in new old; do
    for ov in side serial; do
      e=""; [ $ov = serial ] && e="MEGAMOE_OVERLAP=0"
      env $e MEGAMOE_LOG=megamoe=warn timeout 60 $(bin_of $w) bench forward --backend cuda --shape v4-pro \
        --simulate-ep 8 --tokens 16384 --json $A/ab_${w}${ov}_pro_r$r.json > $A/ab_${w}${ov}_pro_r$r.txt 2>&1
    done
  done
done
python3 .device-carry/ab_table.py $A newside oldside newserial oldserial | tee $A/ab_table.txt; pack
# 2. The T=4096 L1 and L2 of both builds: speed of light, warp states (stall reasons), memory.
for w in new old; do
  timeout 120 ncu --clock-control none -k "regex:moe_wg_l[12]" -c 2 --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 > $A/ncu_l1l2_$w.txt 2>&1
  grep -E "^  moe_|Duration|Stall|DRAM Through|Compute \(SM\)|Issue Slots|Warp Cycles Per Issued" $A/ncu_l1l2_$w.txt | head -40
done
call_end
