#!/usr/bin/env bash
# s41 call 8: MEGAMOE_WG_UNITS default (auto) against one unit a CTA, on another machine: V4-Pro EP8
# rank T=4096 / 16384, V4-Flash T=4096, alternated three times.
set -uo pipefail
CALL=s41c8 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
for r in 1 2 3; do
  for w in auto u1; do
    u=auto; [ $w = u1 ] && u=1
    MEGAMOE_WG_UNITS=$u MEGAMOE_LOG=megamoe=warn timeout 90 $B bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_WG_UNITS=$u MEGAMOE_LOG=megamoe=warn timeout 60 $B bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A auto u1 | tee $A/ab_table.txt
call_end
