#!/usr/bin/env bash
# The forty-first session's third staged call (same staging as call1.sh): W4A8 on MXFP4 experts —
# the bf16 path (default), both GEMMs on the FP8 kernels (MEGAMOE_W4A8_FP8=1) and the new L2-only
# form (=l2: the L1 on the bf16 path) — alternated twice on one binary, V4-Pro EP8 rank T=4096 /
# 16384 and V4-Flash T=4096; the FP8 test (both settings against the host model: l2 within 2e-3);
# verify's W4A8 rows under =l2.
# run(command="bash .device-carry/call3.sh", carry=[".device-carry", ".peers"], timeout_s=600).
set -uo pipefail
CALL=s41c3 source .device-carry/call_env.sh
cat $A/gpu.txt
B=$C/bin/megamoe
fp8_of() { case $1 in bf16) echo 0;; both) echo 1;; l2) echo l2;; esac; }
for r in 1 2; do
  for w in l2 both bf16; do
    f=$(fp8_of $w)
    MEGAMOE_W4A8_FP8=$f MEGAMOE_LOG=megamoe=warn timeout 120 $B bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --format mxfp4 --mode w4a8 --tokens 4096,16384 --json $A/ab_${w}_pro_r$r.json > $A/ab_${w}_pro_r$r.txt 2>&1
    MEGAMOE_W4A8_FP8=$f MEGAMOE_LOG=megamoe=warn timeout 90 $B bench forward --backend cuda --shape v4-flash \
      --format mxfp4 --mode w4a8 --tokens 4096 --json $A/ab_${w}_flash_r$r.json > $A/ab_${w}_flash_r$r.txt 2>&1
  done
done
python3 .device-carry/ab_table.py $A l2 both bf16 | tee $A/ab_table.txt
echo "== ab ${SECONDS}s"; pack
timeout 200 $C/bin/cuda_engine --test-threads=1 --nocapture w4a8_fp8_prefill > $A/w4a8_test.txt 2>&1
grep -E "rel L2|^test |panicked|test result" $A/w4a8_test.txt | head -20
MEGAMOE_W4A8_FP8=l2 timeout 150 $B verify --backend cuda > $A/verify_l2.txt 2>&1; grep -E "verify:|FAIL|W4A8" $A/verify_l2.txt | head -12
call_end
