#!/usr/bin/env bash
# Run HERE (no GPU needed): builds a standalone CUDA probe (scripts/device/*_probe.cu) for sm_90a with
# the CUDA 13.0 nvcc of the PyPI wheels, for a device machine that has no nvcc on its path (copy the
# binary into .device-carry/ after scripts/device.sh). Usage:
#   bash scripts/build_probe.sh scripts/device/ramp_probe.cu .device-carry/ramp_probe
# The wheels (nvidia-cuda-nvcc, -crt, nvidia-nvvm, and scripts/nvrtc_env.sh's nvidia-cuda-runtime)
# are installed once into target/nvcc and merged into one CUDA root there by symbolic links.
set -euo pipefail
cd "$(dirname "$0")/.."
src="$1" out="$2"
deps="$PWD/target/nvcc" root="$PWD/target/nvcc/root"
if [ ! -x "$root/bin/nvcc" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$deps/wheels" \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-runtime==13.0.*"
  rm -rf "$root" && mkdir -p "$root"
  # Each wheel holds part of one CUDA tree (nvidia/cu13/{bin,include,lib,nvvm}): link them into one.
  cp -rs "$deps"/wheels/nvidia/cu13/* "$root"/
fi
"$root/bin/nvcc" -arch=sm_90a -O2 -o "$out" "$src" -L"$root/lib"
echo "built $out"
