#!/usr/bin/env bash
# Runs THERE (on the GPU machine, from the repository root, with .device-carry carried): the CUDA
# tests (both GEMM families), the fixture tests, `megamoe verify`, the GPU demo, traces,
# compute-sanitizer memcheck/racecheck, timings per GEMM family and an ncu summary of the decode
# kernels; logs go to $OUT; a summary table is printed last.
# Env: VERIFY_ARGS (default: the full sweep), PHASE_PROBE=1 (the fused decode kernel's phase clocks), SKIP_TESTS=1, SKIP_VERIFY=1, SKIP_DEMO=1, TIMINGS=0, NCU=0,
# SANITIZE=0 (SANITIZE_VERIFY="memcheck racecheck initcheck": those tools over `verify --quick` too,
# SANITIZE_VERIFY_ARGS=" " the whole sweep; INITCHECK_VERIFY=1 = initcheck), BENCH=1 (the EP-rank bench, when the binary has it), PEERS=1 (../.peers timings, then the rank rows on the triton peer's own routing draw: PEER_ROUTING=0 skips them, PEER_ROUTING_TOKENS),
# EP=1 (in-process EP/TP ranks on this GPU, host and device exchange, per-rank memory, NCCL on one rank), SOAK=1 (10 000 random
# forwards against the reference, device-memory growth), W4A8=1 (W4A8 bench rows on MXFP4 — the
# opt-in FP8 kernels and the default bf16 path — beside W4A16 on the same weights, ncu of the FP8 kernels), BENCH_AB="VAR=VALUE[|VAR=VALUE..]"
# (the decode EP-rank rows again under that environment, e.g. MEGAMOE_STREAM=0), WG_AB="2 3 4" (the
# prefill tests and rows under each MEGAMOE_WG_CONSUMERS), QUANT_DECODE=1 (W4A8 / W4A4 decode rows,
# fused against the separate stages), SWEEP (bench rows under several environments, see below), AB_OLD=path (an earlier binary: the AB_SPECS rows of both builds, alternated),
# RAMP_PROBE=1 (scripts/device/ramp_probe.cu: one-shot DRAM reads of a decode step's bytes from a cold L2),
# NCU_PIPES=1 (per-pipe ncu counters of the wgmma rate probe and of the W4A16 / W4A8 prefill GEMMs: pipes.txt).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# Step logs go to $LOGS and come back as one archive (the device tool returns at most 8 files).
OUT="${OUT:-/tmp/megamoe-out}"; LOGS="$OUT/logs"; mkdir -p "$LOGS"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The golden fixtures: the working tree's (run from the repository root), else a staged copy.
data="$PWD/crates/megamoe/tests/data"; [ -d "$data" ] || data="$here/data"
export MEGAMOE_CACHE="/tmp/megamoe-kernels" MEGAMOE_TEST_DATA="$data" MEGAMOE_REQUIRE_GPU=1
export MEGAMOE_LOG="${MEGAMOE_LOG:-megamoe=info}"
# The kernels precompiled by scripts/device.sh (same NVRTC version, include path and ptxas options).
export MEGAMOE_CUDA_INCLUDE=/usr/local/cuda/include MEGAMOE_PTXAS_VERBOSE=1
if [ -f "$here/kcache.tar.xz" ]; then
  mkdir -p "$MEGAMOE_CACHE" && tar -xJf "$here/kcache.tar.xz" -C /tmp && cp -n /tmp/kcache/* "$MEGAMOE_CACHE"/
fi
declare -A status
order=()
step() { # name, command...
  local name="$1"; shift
  local t0=$(date +%s)
  order+=("$name")
  echo "=== $name: $*" | tee -a "$OUT/log.txt"
  "$@" >"$LOGS/$name.log" 2>&1; local rc=$?
  tail -n 25 "$LOGS/$name.log"
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  echo "=== $name: rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
  # The archive so far: a call cut short by its time limit still returns every finished step's log.
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
chmod +x "$here"/bin/*
bin="${RUN_BIN:-$here/bin/megamoe}"   # RUN_BIN: another staged binary (e.g. .device-carry/old/megamoe)
# TEST_FILTER: only the cuda_engine tests matching it (e.g. a first run of a new kernel), TEST_TIMEOUT.
[ "${SKIP_TESTS:-0}" != 1 ] && [ -x "$here/bin/cuda_engine" ] && step tests timeout "${TEST_TIMEOUT:-480}" \
  "$here/bin/cuda_engine" --test-threads 1 --nocapture ${TEST_FILTER:-}
[ "${SKIP_TESTS:-0}" != 1 ] && [ -x "$here/bin/cuda_fixtures" ] && step fixtures "$here/bin/cuda_fixtures" --test-threads 1 --nocapture
# NCCL from the Python environment (the EP tests' one-rank communicator, EP=1's steps).
nccl_lib="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)"
[ -f "$nccl_lib" ] || nccl_lib="$(find / -name 'libnccl.so.2' 2>/dev/null | head -1)"
# Expert parallelism on this GPU: the device-resident exchange (groups of 1..8 ranks, graph replay,
# NCCL on one rank) and the host path's CUDA rank engines (EP_TEST_FILTER: a part of them).
[ "${SKIP_TESTS:-0}" != 1 ] && [ -x "$here/bin/cuda_ep" ] && step ep_tests env NCCL_NVLS_ENABLE=0 \
  MEGAMOE_NCCL_LIB="$nccl_lib" timeout 400 "$here/bin/cuda_ep" --test-threads 1 --nocapture ${EP_TEST_FILTER:-}
if [ "${SKIP_VERIFY:-0}" != 1 ]; then
  step verify timeout "${VERIFY_TIMEOUT:-300}" "$bin" verify --backend cuda ${VERIFY_ARGS:-}
fi
# The main job on the GPU: the full V4-Pro layer (384 experts) against the CPU reference.
[ "${SKIP_DEMO:-0}" != 1 ] && step demo timeout 240 "$bin" demo --backend cuda
act="$data/activations"
[ "${SKIP_TESTS:-0}" != 1 ] && step trace_clean "$bin" trace --backend cuda --checkpoint "$data/nvfp4-tiny" --layer 1 \
  --input "$act/nvfp4-L1-in.safetensors" --expect "$act/nvfp4-L1-expect.safetensors"
[ "${SKIP_TESTS:-0}" != 1 ] && step trace_fault env MEGAMOE_FAULT=scale_layout "$bin" trace --backend cuda \
  --checkpoint "$data/nvfp4-tiny" --layer 1 --input "$act/nvfp4-L1-in.safetensors"
if [ "${SANITIZE:-1}" != 0 ]; then
  # SANITIZE_TESTS / RACECHECK_TESTS: narrower lists for a short call; SANITIZE_TIMEOUT bounds each.
  st="${SANITIZE_TIMEOUT:-900}"
  step memcheck timeout "$st" compute-sanitizer --tool memcheck --error-exitcode 9 "$here/bin/cuda_engine" --test-threads 1 \
    ${SANITIZE_TESTS:-trace_records nan_and_inf repeat_runs external_routing large_batch w4a8_fp8 prefill_fitted decode_split tiny_plan concurrent_streams fused_decode}
  step racecheck timeout "$st" compute-sanitizer --tool racecheck --error-exitcode 9 "$here/bin/cuda_engine" --test-threads 1 \
    ${RACECHECK_TESTS:-trace_records external_routing w4a8_fp8 decode_split tiny_plan fused_decode}
  # The EP exchange's kernels (pack, rows, reduce) and the NCCL rounds; NCCL's own probing of its
  # kernel images fails API calls it tolerates, so API errors are not reported there.
  [ -x "$here/bin/cuda_ep" ] && for tool in memcheck racecheck; do
    step "${tool}_ep" env NCCL_NVLS_ENABLE=0 MEGAMOE_NCCL_LIB="$nccl_lib" timeout 300 compute-sanitizer --tool "$tool" \
      --report-api-errors no --error-exitcode 9 "$here/bin/cuda_ep" --test-threads 1 ${SANITIZE_EP_TESTS:-refuses nccl cuda_rank fp8}
  done
  [ "${INITCHECK:-1}" != 0 ] && step initcheck timeout "$st" compute-sanitizer --tool initcheck --error-exitcode 9 "$here/bin/cuda_engine" \
    --test-threads 1 ${INITCHECK_TESTS:-w4a8_fp8 prefill_tiles decode_path decode_split tiny_plan fused_decode}
  # compute-sanitizer over the verify sweep (every family, format and mode): SANITIZE_VERIFY="memcheck
  # racecheck initcheck" (any of them; INITCHECK_VERIFY=1 adds initcheck); SANITIZE_VERIFY_ARGS: the
  # sweep's options (default --quick; " " runs the whole sweep, its large rows take minutes there).
  sv="${SANITIZE_VERIFY:-}"; [ "${INITCHECK_VERIFY:-0}" != 0 ] && sv="$sv initcheck"
  for tool in $sv; do
    step "${tool}_verify" timeout "${SANITIZE_VERIFY_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$bin" verify --backend cuda ${SANITIZE_VERIFY_ARGS:---quick}
  done
fi
if [ "${TIMINGS:-1}" != 0 ]; then
  step timings_tc env MEGAMOE_GEMM=tc "$bin" verify --backend cuda --timings-only
  step timings_simt env MEGAMOE_GEMM=simt "$bin" verify --backend cuda --timings-only
fi
if [ "${BENCH:-0}" != 0 ]; then
  # One V4-Pro EP8 rank (48 of 384 experts) and the whole V4-Pro layer; then V4-Flash whole.
  step bench timeout 500 "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --whole-layer \
    --tokens "${BENCH_TOKENS:-1,8,64,512,4096,16384}" --json "$OUT/bench.json" ${BENCH_ARGS:-}
  step bench_flash timeout 300 "$bin" bench forward --backend cuda --shape v4-flash --whole-layer \
    --tokens "${FLASH_TOKENS:-1,64,4096}" --json "$OUT/bench_flash.json" ${BENCH_ARGS:-}
fi
# PHASE_PROBE=1: the fused decode kernel's phase clocks (the DS_PROBE build, its own kernel
# cache entries; precompile them with MEGAMOE_PHASE_PROBE=1 megamoe kernels) under each rank row.
if [ "${PHASE_PROBE:-0}" != 0 ]; then
  # PROBE_MODES: the modes probed (e.g. "w4a16 w4a8").
  for pm in ${PROBE_MODES:-w4a16}; do
    step "phase_probe_$pm" env MEGAMOE_PHASE_PROBE=1 timeout 300 "$bin" bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --mode "$pm" --tokens "${PROBE_TOKENS:-1,8}" --iters 5
  done
fi
if [ -n "${BENCH_AB:-}" ]; then
  # The same EP-rank rows under another configuration (e.g. BENCH_AB="MEGAMOE_STREAM=0": the
  # decode tiles on the mma.sync kernels instead of the streaming ones), in the same call; several
  # configurations separated by "|" run one after the other (bench_ab, bench_ab2, ...).
  n=0
  IFS='|' read -ra ab_cfgs <<<"$BENCH_AB"
  for cfg in "${ab_cfgs[@]}"; do
    n=$((n + 1)); tag=bench_ab; [ "$n" -gt 1 ] && tag="bench_ab$n"
    # shellcheck disable=SC2086
    step "$tag" timeout 300 env $cfg "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --whole-layer --tokens "${BENCH_AB_TOKENS:-1,8,64}" --json "$OUT/$tag.json"
  done
fi
if [ -n "${SWEEP:-}" ]; then
  # Bench rows under several configurations in one call: SWEEP holds lines "TAG [VAR=VALUE ..] --
  # <bench forward options>" (e.g. "w8t96 MEGAMOE_W4A8_FP8=1 MEGAMOE_W4A8_TILE=96 -- --shape v4-pro
  # --simulate-ep 8 --format mxfp4 --mode w4a8 --tokens 4096"); each line is a step sweep_TAG whose
  # rows go to $OUT/sweep_TAG.json.
  while read -r tag rest; do
    [ -z "$tag" ] && continue
    envs="${rest%%--*}"; opts="${rest#*-- }"
    # shellcheck disable=SC2086
    step "sweep_$tag" timeout "${SWEEP_TIMEOUT:-200}" env $envs "$bin" bench forward --backend cuda $opts \
      --json "$OUT/sweep_$tag.json"
  done <<<"$SWEEP"
fi
if [ "${QUANT_DECODE:-0}" != 0 ]; then
  # The quantized modes' decode rows (EP-rank): W4A8 on MXFP4 and NVFP4, W4A4 on NVFP4, the fused
  # kernel (default) against the separate stages (MEGAMOE_FUSED=0), W4A16 beside them.
  qd="${QUANT_DECODE_TOKENS:-1,8,64}"
  for spec in "mxfp4 w4a8" "nvfp4 w4a8" "nvfp4 w4a4" "mxfp4 w4a16"; do
    set -- $spec
    step "qd_$1_$2" timeout 200 "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --format "$1" \
      --mode "$2" --tokens "$qd" --json "$OUT/qd_$1_$2.json"
    [ "$2" != w4a16 ] && step "qd_$1_$2_separate" timeout 200 env MEGAMOE_FUSED=0 "$bin" bench forward --backend cuda \
      --shape v4-pro --simulate-ep 8 --format "$1" --mode "$2" --tokens "$qd" --json "$OUT/qd_$1_$2_sep.json"
  done
fi
if [ -n "${WG_AB:-}" ]; then
  # The wgmma prefill kernels under each consumer-warpgroup count of WG_AB (MEGAMOE_WG_CONSUMERS,
  # e.g. "2 3 4"): the prefill tests, then the EP-rank prefill rows and V4-Flash at T=4096.
  for c in $WG_AB; do
    [ -x "$here/bin/cuda_engine" ] && step "wg${c}_tests" env MEGAMOE_WG_CONSUMERS="$c" timeout 300 \
      "$here/bin/cuda_engine" --test-threads 1 --nocapture prefill
    step "wg${c}_bench" env MEGAMOE_WG_CONSUMERS="$c" timeout 300 "$bin" bench forward --backend cuda --shape v4-pro \
      --simulate-ep 8 --tokens "${WG_AB_TOKENS:-512,4096,16384}" --json "$OUT/bench_wg$c.json"
    step "wg${c}_flash" env MEGAMOE_WG_CONSUMERS="$c" timeout 300 "$bin" bench forward --backend cuda --shape v4-flash \
      --tokens 4096 --json "$OUT/bench_flash_wg$c.json"
  done
fi
if [ "${W4A8:-0}" != 0 ]; then
  # W4A8 (DeepSeek's act_quant activations) on MXFP4 experts: the opt-in FP8 kernels
  # (MEGAMOE_W4A8_FP8=1) and the default exact bf16 path; W4A16 on the same MXFP4 weights beside
  # them; then the FP8 kernels under ncu at T=4096.
  w8t="${W4A8_TOKENS:-1,64,512,4096,16384}"
  step fp8_rate timeout 120 python3 "$here/fp8_rate.py" --json "$OUT/fp8_rate.json"
  step bench_w4a8 timeout 400 env MEGAMOE_W4A8_FP8=1 "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
    --format mxfp4 --mode w4a8 --tokens "$w8t" --json "$OUT/bench_w4a8.json"
  step bench_w4a8_bf16 timeout 400 "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --format mxfp4 \
    --mode w4a8 --tokens "$w8t" --json "$OUT/bench_w4a8_bf16.json"
  step bench_mx16 timeout 400 "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --format mxfp4 \
    --mode w4a16 --tokens "$w8t" --json "$OUT/bench_mx16.json"
  step bench_w4a8_flash timeout 300 env MEGAMOE_W4A8_FP8=1 "$bin" bench forward --backend cuda --shape v4-flash \
    --format mxfp4 --mode w4a8 --tokens 4096 --json "$OUT/bench_w4a8_flash.json"
  step bench_w4a8_bf16_flash timeout 300 "$bin" bench forward --backend cuda --shape v4-flash --format mxfp4 \
    --mode w4a8 --tokens 4096 --json "$OUT/bench_w4a8_bf16_flash.json"
  if command -v ncu >/dev/null; then
    step ncu_w4a8 timeout 300 env MEGAMOE_W4A8_FP8=1 ncu --clock-control none -k "regex:moe_(w8|quant)" --launch-count 6 \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread \
      "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --format mxfp4 --mode w4a8 --tokens 4096 --iters 1
  fi
fi
if [ "${EP:-0}" != 0 ]; then
  # Expert / tensor parallelism with in-process ranks sharing this GPU (a stream each), each row
  # against EP=1 and the CPU reference; per-rank device memory of a V4-Pro layer at EP=8 vs EP=1;
  # the NCCL transport on a 1-rank communicator (libnccl from the Python environment).
  # EP_HOST=0 skips the host-exchange rows, EP_MEM=0 the per-rank memory rows (whole V4-Pro layers).
  if [ "${EP_HOST:-1}" != 0 ]; then
    step ep2 timeout 300 "$bin" verify --backend cuda --ep 2 --quick
    step ep8 timeout 300 "$bin" verify --backend cuda --ep 8 --quick
    step ep2tp2 timeout 300 "$bin" verify --backend cuda --ep 2 --tp 2 --quick
  fi
  # The device-resident exchange over the whole verify sweep (every row's repeat is the group's
  # CUDA-graph replay), EP x TP, NCCL on one rank, and the whole group's graph on V4-Pro shapes.
  step ep2dev timeout 400 "$bin" verify --backend cuda --ep 2 --exchange device
  step ep8dev timeout 400 "$bin" verify --backend cuda --ep 8 --exchange device
  step ep2tp2dev timeout 300 "$bin" verify --backend cuda --ep 2 --tp 2 --exchange device --quick
  step ep8dev_fp8 timeout 300 "$bin" verify --backend cuda --ep 8 --exchange device --dispatch-payload fp8 --quick
  step nccl1dev timeout 200 env NCCL_NVLS_ENABLE=0 MEGAMOE_NCCL_LIB="$nccl_lib" "$bin" verify --backend cuda \
    --ep 1 --transport nccl --exchange device --quick
  step ep8dev_bench timeout 300 "$bin" bench forward --backend cuda --shape v4-pro --ep 8 --exchange device \
    --tokens "${EP_BENCH_TOKENS:-8,64,512}" --runs 5
  if [ "${EP_MEM:-1}" != 0 ]; then
    step ep_mem8 timeout 300 "$bin" bench forward --backend cuda --shape v4-pro --ep 8 --tokens 64 --runs 3
    step ep_mem1 timeout 300 "$bin" bench forward --backend cuda --shape v4-pro --ep 1 --tokens 64 --runs 3
  fi
  step nccl1 timeout 200 env NCCL_NVLS_ENABLE=0 MEGAMOE_NCCL_LIB="$nccl_lib" "$bin" verify --backend cuda --ep 1 \
    --transport nccl --quick
  step launch1 timeout 200 env NCCL_NVLS_ENABLE=0 MEGAMOE_NCCL_LIB="$nccl_lib" "$bin" launch --gpus 1 -- verify \
    --backend cuda --ep 1 --transport nccl --quick
fi
if [ "${SOAK:-0}" != 0 ]; then
  # Issue 14's soak: 10 000 forwards of random shape, mode and routing on the GPU, checked against the
  # CPU reference every 100, free device memory after the warm-up vs the end.
  step soak timeout 550 "$bin" soak --backend cuda --forwards "${SOAK_FORWARDS:-10000}" --check-every 100
fi
if [ "${RUN_MODEL:-0}" != 0 ]; then
  # The model runtime: a 61-layer V4-Pro-shaped stack (16 experts a layer) on one device, one stream,
  # one workspace; eager per-layer times, whole-model graph replay (bitwise vs eager), memory, drift.
  step run_model timeout 400 "$bin" run-model --synthetic v4-pro --layers 61 --experts 16 --tokens 64 \
    --backend cuda --graph
fi
if [ "${PEERS:-0}" != 0 ] && [ -d .peers ]; then
  step peers_torch timeout 300 env PYTHONUNBUFFERED=1 python3 .peers/torch_baselines.py --json "$OUT/peers_torch.json"
  step peers_triton timeout 400 env PYTHONUNBUFFERED=1 PYTHONPATH=.peers/triton_kernels_pkg \
    python3 .peers/triton_kernels_moe.py --json "$OUT/peers_triton.json"
  # The rank rows again on the triton peer's own routing draw (the same pairs, the same experts
  # touched: scripts/peer_routing.py), in both FP4 formats (the peer's weights are MXFP4).
  if [ "${PEER_ROUTING:-1}" != 0 ] && [ -f scripts/peer_routing.py ]; then
    step peer_routing python3 scripts/peer_routing.py --peer .peers/triton_kernels_moe.py \
      --tokens "${PEER_ROUTING_TOKENS:-1,8,64,512,4096,16384}" --out /tmp/peer_routing.json
    for fmt in nvfp4 mxfp4; do
      step "bench_same_$fmt" timeout 300 "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
        --format "$fmt" --tokens "${PEER_ROUTING_TOKENS:-1,8,64,512,4096,16384}" --routing /tmp/peer_routing.json \
        --json "$OUT/bench_same_$fmt.json"
    done
  fi
fi
if [ -f "$OUT/bench.json" ] && [ -f scripts/plot_roofline.py ]; then
  step plot python3 scripts/plot_roofline.py $(ls "$OUT"/bench*.json | grep -v bench_same_) $(ls "$OUT"/peers_*.json 2>/dev/null) --out "$OUT/roofline.png"
fi
if [ "${NCU_BENCH:-0}" != 0 ] && command -v ncu >/dev/null; then
  # Every megamoe kernel of the EP-rank rows (default T=1, 64, 4096; first launches of each row:
  # plan, GEMMs, combine; flush memsets excluded): per-kernel time, DRAM, tensor pipe, issue.
  step ncu_bench timeout 300 ncu --clock-control none -k "regex:moe_" --launch-count "${NCU_LAUNCHES:-48}" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread \
    "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens "${NCU_TOKENS:-1,64,4096}" --iters 1
fi
if [ "${NCU_DETAIL:-0}" != 0 ] && command -v ncu >/dev/null; then
  # Full ncu sections (warp stall reasons, pipes, memory) and per-SASS-line counters of the hot GEMMs:
  # the prefill wgmma L1/L2 at T=4096 and the decode L1/L2 at T=1 and 8 on the EP rank (NVFP4, W4A16;
  # NCU_DETAIL_ARGS adds bench options, e.g. "--format mxfp4 --mode w4a8" with a moe_w8_l spec;
  # NCU_DETAIL_ENV an environment for them, e.g. MEGAMOE_W4A8_FP8=1).
  for spec in ${NCU_DETAIL_SPECS:-"wg:regex:moe_wg_l:4096:2" "tc:regex:moe_tc_l:1,8:4"}; do
    IFS=: read -r tag kind kre toks n <<<"$spec"
    step "ncu_detail_$tag" timeout 400 env ${NCU_DETAIL_ENV:-} ncu --clock-control none --set full --import-source no -k "$kind:$kre" \
      --launch-count "$n" -o "$OUT/detail_$tag" -f "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 \
      --tokens "$toks" --iters 1 ${NCU_DETAIL_ARGS:-}
    ncu -i "$OUT/detail_$tag.ncu-rep" --page details > "$LOGS/detail_$tag.txt" 2>&1
    ncu -i "$OUT/detail_$tag.ncu-rep" --page source --csv --print-source sass > "$LOGS/source_$tag.csv" 2>&1
    rm -f "$OUT/detail_$tag.ncu-rep"
  done
fi
if [ "${RAMP_PROBE:-0}" != 0 ]; then
  # How long a one-shot read of a decode step's bytes takes from a cold L2 (scripts/device/ramp_probe.cu):
  # the practical floor of a one-token step against the bytes / copy-bandwidth one. Built here when
  # the machine has nvcc, else the binary scripts/build_probe.sh built and staged in the carry.
  if command -v nvcc >/dev/null && nvcc -arch=sm_90a -O2 -o /tmp/ramp_probe scripts/device/ramp_probe.cu >/dev/null 2>&1; then
    step ramp_probe timeout 300 /tmp/ramp_probe
  elif [ -f .device-carry/ramp_probe ]; then
    chmod +x .device-carry/ramp_probe && step ramp_probe timeout 300 .device-carry/ramp_probe
  fi
fi
if [ "${NCU_PIPES:-0}" != 0 ] && command -v ncu >/dev/null; then
  # Which pipe bounds the wgmma consumer loops: per-pipe issue and busy counters (ALU, FMA, FMA-heavy,
  # tensor, uniform, ...) and issue slots of the rate probe's configurations (one launch each) and of
  # the W4A16 wgmma and W4A8 FP8 L1 / L2 at T=4096 on the V4-Pro EP8 rank; summarised in pipes.txt.
  pm='regex:^sm__(inst_executed_pipe|pipe)_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active$,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum'
  if nvcc -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/wgmma_probe scripts/device/wgmma_rate_probe.cu >/dev/null 2>&1; then
    step pipes_probe env PROBE_LAUNCHES=1 timeout 200 ncu --clock-control none --metrics "$pm" --csv /tmp/wgmma_probe
  fi
  step pipes_wg timeout 200 ncu --clock-control none -k regex:moe_wg_l --launch-count 2 --metrics "$pm" --csv \
    "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1
  step pipes_w8 timeout 200 env MEGAMOE_W4A8_FP8=1 ncu --clock-control none -k regex:moe_w8_l --launch-count 2 --metrics "$pm" \
    --csv "$bin" bench forward --backend cuda --shape v4-pro --simulate-ep 8 --tokens 4096 --iters 1 --format mxfp4 --mode w4a8
  python3 - "$LOGS" > "$LOGS/pipes.txt" 2>&1 <<'PY'
import collections, csv, os, sys
for name in ("pipes_probe", "pipes_wg", "pipes_w8"):
    path = os.path.join(sys.argv[1], name + ".log")
    if not os.path.exists(path):
        continue
    rows = [l for l in open(path, errors="replace") if l.startswith('"')]
    by = collections.OrderedDict()
    for r in csv.DictReader(rows):
        by.setdefault((r.get("ID"), r.get("Kernel Name", "")[:48]), {})[r.get("Metric Name")] = r.get("Metric Value")
    print("==", name)
    for (i, k), m in by.items():
        print(i, k, {n.replace(".avg.pct_of_peak_sustained_active", ""): v for n, v in m.items() if v not in ("0", "0.00")})
PY
fi
if [ -n "${AB_OLD:-}" ]; then
  # Two builds in one call: this one and AB_OLD (an earlier `megamoe` binary staged beside it by
  # scripts/device.sh AB_OLD_BIN=...; both find their kernels in the same cache), alternated
  # AB_ROUNDS times over the AB_SPECS rows
  # ("shape format mode [VAR=VALUE]" lines; W4A8 on the FP8 kernels unless the line says
  # MEGAMOE_W4A8_FP8=0) of AB_TOKENS.
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for which in new old; do
      b="$bin"; [ "$which" = old ] && b="$AB_OLD"
      while read -r shape fmt mode extra; do
        [ -z "$shape" ] && continue
        ep=""; [ "$shape" = v4-pro ] && ep="--simulate-ep 8"
        tag="${which}_${shape}_${fmt}_${mode}${extra:+_${extra//[^A-Za-z0-9]/}}_r$r"
        step "ab_$tag" timeout 200 env MEGAMOE_W4A8_FP8=1 $extra "$b" bench forward --backend cuda \
          --shape "$shape" $ep --format "$fmt" --mode "$mode" --tokens "${AB_TOKENS:-4096,16384}" --json "$OUT/ab_$tag.json"
      done <<<"${AB_SPECS:-v4-pro nvfp4 w4a16
v4-pro mxfp4 w4a8
v4-flash nvfp4 w4a16}"
    done
  done
fi
if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
  # The first tensor-core launches of the timings run: the T=1 decode L1 / L2 and the shared expert.
  step ncu timeout 240 env MEGAMOE_GEMM=tc ncu --clock-control none -k regex:moe_tc --launch-count 6 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread \
    "$bin" verify --backend cuda --timings-only
fi
echo; echo "================ SUMMARY ================"
for k in "${order[@]}"; do printf "%-13s %s\n" "$k" "${status[$k]}"; done
for f in memcheck racecheck initcheck memcheck_verify racecheck_verify initcheck_verify; do [ -f "$LOGS/$f.log" ] && echo "$f: $(grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS/$f.log" | tail -1)"; done
grep -hE "^test result" "$LOGS"/tests.log "$LOGS"/fixtures.log 2>/dev/null
grep -hE "panicked|FAILED" "$LOGS"/tests.log 2>/dev/null | head -20
[ -f "$LOGS/verify.log" ] && grep -E "backend under test|FAIL|all rows" "$LOGS/verify.log" | head -12
grep -h "first divergence:" "$LOGS"/trace_*.log 2>/dev/null
for f in timings_tc timings_simt; do [ -f "$LOGS/$f.log" ] && { echo "--- $f"; grep -vE "^\s*$|generated" "$LOGS/$f.log" | tail -n 9; }; done
[ -f "$LOGS/ncu.log" ] && grep -E "moe_tc|gpu__time|dram__throughput|issue_active|grid_size" "$LOGS/ncu.log" | head -40
[ -f "$LOGS/ncu_bench.log" ] && grep -E "  moe_|gpu__time|dram__throughput|tensor|issue_active|grid_size" "$LOGS/ncu_bench.log" | head -150
for f in ep_tests ep2 ep8 ep2tp2 ep2dev ep8dev ep2tp2dev ep8dev_fp8 nccl1dev ep8dev_bench ep_mem8 ep_mem1 nccl1 launch1; do [ -f "$LOGS/$f.log" ] && { echo "--- $f"; grep -vE "^\s*$|INFO|WARN" "$LOGS/$f.log" | tail -n 8; }; done
[ -f "$LOGS/pipes.txt" ] && { echo "--- pipes"; cat "$LOGS/pipes.txt"; }
[ -f "$LOGS/ncu_w4a8.log" ] && grep -E "  moe_|gpu__time|dram__throughput|tensor|gmma|issue_active|shared|grid_size" "$LOGS/ncu_w4a8.log" | head -60
grep -h "W4A8" "$LOGS/tests.log" 2>/dev/null
for c in ${WG_AB:-}; do for f in wg${c}_tests wg${c}_bench wg${c}_flash; do [ -f "$LOGS/$f.log" ] && { echo "--- $f"; grep -E "rank |test result|panicked|rel L2|whole-layer" "$LOGS/$f.log" | tail -n 14; }; done; done
for f in "$LOGS"/ab_*.log; do [ -f "$f" ] && { echo "--- $(basename "$f" .log)"; grep -E "^v4-" "$f"; }; done
for f in fp8_rate soak run_model bench bench_ab bench_ab2 bench_ab3 bench_flash bench_w4a8 bench_w4a8_bf16 bench_mx16 bench_w4a8_flash bench_w4a8_bf16_flash peers_torch peers_triton peer_routing bench_same_nvfp4 bench_same_mxfp4; do [ -f "$LOGS/$f.log" ] && { echo "--- $f"; grep -vE "^\s*$|INFO|WARN" "$LOGS/$f.log" | tail -n 22; }; done
# The device tool returns at most 8 files: the JSON results and plots travel inside the archive.
for f in "$OUT"/*.json "$OUT"/*.png; do [ -f "$f" ] && mv "$f" "$LOGS/"; done
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit 0
