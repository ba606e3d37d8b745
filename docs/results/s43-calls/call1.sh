#!/usr/bin/env bash
# Staged in the forty-third session (not run: no device was lent). ~560 s. Stage:
# `BASE=93cd9c6 PROBE=0 PRECOMPILE_ENVS=MEGAMOE_WG_STAGE=1 bash scripts/stage_calls.sh docs/results/s43-calls`
# (this build as "new", the forty-second session's final build as "old"; MEGAMOE_WG_STAGE=1's
# modules precompiled), then run(command="bash .device-carry/call1.sh", carry=[".device-carry", ".peers"]).
# 0. The tests never run on a GPU: the wgmma L1 staging its own inputs (MEGAMOE_WG_STAGE=1,
#    bitwise against the staging pass) and the 80-token FP8 tile (W4A8, both FP8 settings).
# 1. A/B, one binary: the L1 staging its inputs against the moe_quant_rows pass (V4-Pro EP8 rank
#    T=4096,16384 and V4-Flash T=4096, three rounds alternated); W4A8 l2 / both / bf16 rows.
# 2. The rank + shared T=16384 regression of the forty-second session (new vs old x side/serial).
# 3. ncu of the T=4096 L1 / L2 (stall reasons) with and without the L1's own staging.
set -uo pipefail
CALL=s43c1 source .device-carry/call_env.sh
cat $A/gpu.txt
bin_of() { case $1 in new) echo $C/bin/megamoe;; old) echo $C/old/megamoe;; esac; }
timeout 150 $C/bin/cuda_engine --test-threads=1 --nocapture prefill_l1_staging_its_inputs > $A/stage_test.txt 2>&1
grep -E "bitwise|^test |panicked|test result" $A/stage_test.txt | head -14; pack
timeout 120 $C/bin/cuda_engine --test-threads=1 --nocapture w4a8_fp8_prefill > $A/w4a8_test.txt 2>&1
grep -E "rel L2|^test |panicked|test result" $A/w4a8_test.txt | head -14; pack
# 1. Same binary, staging pass ("pass") against the L1's own ("own").
for r in 1 2 3; do
  for w in own pass; do
    e="MEGAMOE_WG_STAGE=0"; [ $w = own ] && e="MEGAMOE_WG_STAGE=1"
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $C/bin/megamoe bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $C/bin/megamoe bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A own pass | tee $A/ab_stage.txt; pack
for w in l2 both bf16; do
  f=0; [ $w = l2 ] && f=l2; [ $w = both ] && f=1
  MEGAMOE_W4A8_FP8=$f MEGAMOE_LOG=megamoe=warn timeout 80 $C/bin/megamoe bench forward --backend cuda --shape v4-pro \
    --simulate-ep 8 --format mxfp4 --mode w4a8 --tokens 4096,16384 --json $A/ab_w8${w}_w4a8_r1.json > $A/ab_w8${w}_w4a8_r1.txt 2>&1
done
python3 .device-carry/ab_table.py $A w8l2 w8both w8bf16 | tee $A/ab_w4a8.txt; pack
# 2. rank + shared T=16384: the shared expert beside (default) and after (MEGAMOE_OVERLAP=0).
for w in new old; do
  for ov in side serial; do
    e=""; [ $ov = serial ] && e="MEGAMOE_OVERLAP=0"
    env $e MEGAMOE_LOG=megamoe=warn timeout 60 $(bin_of $w) bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --tokens 16384 --json $A/ab_${w}${ov}_rs_r1.json > $A/ab_${w}${ov}_rs_r1.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A newside oldside newserial oldserial | tee $A/ab_shared.txt; pack
# 3. ncu: the T=4096 L1 / L2 and the staging pass, without and with the L1's own staging.
for w in pass own; do
  e="MEGAMOE_WG_STAGE=0"; [ $w = own ] && e="MEGAMOE_WG_STAGE=1"
  env $e timeout 120 ncu --clock-control none -k "regex:moe_wg_l[12]|moe_quant_rows" -c 3 --section SpeedOfLight \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
    $C/bin/megamoe bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 > $A/ncu_$w.txt 2>&1
  grep -E "^  moe_|Duration|Stall|DRAM Through|Compute \(SM\)|Warp Cycles Per Issued" $A/ncu_$w.txt | head -30
done
call_end
