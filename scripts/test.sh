#!/usr/bin/env bash
# Runs every test. Works on a fresh machine with Rust and Python: installs the NVRTC wheels that let
# the CUDA kernels be compile-checked without a GPU, runs the whole workspace's tests, then builds
# and installs the Python package (`pip install .` in a fresh virtual environment) and runs the
# Python tests (those needing torch or a GPU skip cleanly where they are absent).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/nvrtc_env.sh
# A one-shot build gains nothing from incremental state (~0.8 GB under target/debug/incremental).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test --workspace "$@"

venv="$PWD/target/pyvenv-test"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check maturin numpy pytest
# What a user runs: a release build of the extension (maturin, via pip's PEP 517 build).
"$venv/bin/pip" install --quiet --disable-pip-version-check .
(cd /tmp && "$venv/bin/python" -c "import megamoe; print('megamoe', megamoe.__version__, 'imported from', megamoe.__file__)")
"$venv/bin/python" -m pytest tests/python -q -rs -p no:cacheprovider
