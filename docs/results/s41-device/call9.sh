#!/usr/bin/env bash
# s41 call 9: the zero rows as streaming stores (st.global.cs, "cs") against the final build ("cur"),
# alternated twice (V4-Pro EP8 rank T=4096 / 16384, V4-Flash T=4096); ncu of L1 / L2 / combine at
# T=4096; verify --quick of cs.
set -uo pipefail
CALL=s41c9 source .device-carry/call_env.sh
cat $A/gpu.txt
chmod +x $C/cs/megamoe
bin_of() { case $1 in cs) echo $C/cs/megamoe;; cur) echo $C/bin/megamoe;; esac; }
for r in 1 2; do
  for w in cs cur; do
    b=$(bin_of $w)
    MEGAMOE_LOG=megamoe=warn timeout 90 $b bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_LOG=megamoe=warn timeout 60 $b bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A cs cur | tee $A/ab_table.txt; pack
for w in cs cur; do
  timeout 60 ncu --clock-control none -k "regex:moe_(wg|combine)" -c 3 --metrics gpu__time_duration.sum,dram__bytes_write.sum,dram__bytes_read.sum \
    $(bin_of $w) bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 2>&1 \
    | grep -E "^  moe_|gpu__time|dram__bytes" | tee $A/ncu_$w.txt | grep -E "^  moe_|gpu__time" | paste - - | awk -v w=$w '{print w, $1, $NF}'
done
timeout 60 $C/cs/megamoe verify --backend cuda --quick > $A/verify_cs.txt 2>&1; grep -E "verify:|FAIL" $A/verify_cs.txt | head -3
call_end
