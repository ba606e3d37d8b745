#!/usr/bin/env bash
# The Python binding on a GPU machine. Two halves:
#
#   HERE (network, no GPU):  bash scripts/python_device.sh stage
#     builds the abi3 wheel (maturin build --release) into target/wheels/ and downloads pytest's
#     pure-Python wheels into target/wheels/deps/, then prints the device call to make.
#
#   THERE (GPU, torch, no network):  bash scripts/python_device.sh
#     installs the carried wheel with `pip install --no-deps --no-index` (and pytest from
#     target/wheels/deps when it is missing), then runs the Python tests (the GPU ones run there;
#     the CPU ones too), the example on the GPU and a larger-batch example, writing logs to
#     "$OUT" (default target/python-device-out). numpy and torch must already be installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels="$PWD/target/wheels"

if [ "${1:-}" = "stage" ]; then
  set -e
  venv="$PWD/target/pyvenv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet maturin
  rm -f "$wheels"/megamoe-*.whl
  "$venv/bin/maturin" build --release -o "$wheels"
  "$venv/bin/pip" download --quiet --only-binary=:all: --dest "$wheels/deps" pytest
  du -sh "$wheels"
  cat <<MSG
Staged in $wheels. Now call the device tool:
  run(command="bash scripts/python_device.sh", carry=["target/wheels"], timeout_s=600)
MSG
  exit 0
fi

OUT="${OUT:-$PWD/target/python-device-out}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
# The manylinux wheel of `stage` (a plain linux_x86_64 one may also be left by a local `pip install .`).
wheel=$(ls -t "$wheels"/megamoe-*manylinux*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || wheel=$(ls -t "$wheels"/megamoe-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  echo "no megamoe wheel in $wheels: run 'bash scripts/python_device.sh stage' here first and carry target/wheels" >&2
  exit 2
fi
{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
  "$py" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "numpy", numpy.__version__)'
  echo "== install $wheel"
  # A distribution's own Python may refuse pip installs (PEP 668): then say so explicitly.
  pipi() { "$py" -m pip install --disable-pip-version-check "$@" || "$py" -m pip install --disable-pip-version-check --break-system-packages "$@"; }
  pipi --no-deps --no-index --force-reinstall "$wheel"
  if ! "$py" -c 'import pytest' 2>/dev/null; then
    pipi --no-index --find-links "$wheels/deps" pytest
  fi
  # Import the installed package, not the sources (tests/python adds only itself to sys.path).
  "$py" -c 'import megamoe; print("megamoe", megamoe.__version__, "cuda support", megamoe.has_cuda_support(), megamoe.__file__)'
} 2>&1 | tee "$OUT/install.log"

status=0
echo "== pytest" | tee "$OUT/pytest.log"
"$py" -m pytest tests/python -v -rs -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" 2>&1 | tee -a "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== example" | tee "$OUT/example.log"
for t in 64 2048; do
  "$py" examples/deepseek_v4_moe.py --device cuda --tokens "$t" --layer 1 2>&1 | tee -a "$OUT/example.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "== summary"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -2
grep -E "relative L2|megamoe |torch " "$OUT/example.log"
echo "logs in $OUT; exit $status"
exit $status
