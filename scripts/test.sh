#!/usr/bin/env bash
# Runs every test. Works on a fresh machine with Rust and Python: installs the NVRTC wheels that let
# the CUDA kernels be compile-checked without a GPU, then runs the whole workspace's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/nvrtc_env.sh
cargo test --workspace "$@"
