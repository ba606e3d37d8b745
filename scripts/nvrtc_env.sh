# Sourced by scripts: installs (once, into target/pydeps) the PyPI wheels nvidia-cuda-nvrtc and
# nvidia-cuda-runtime, and points MEGAMOE_NVRTC_LIB_DIR / MEGAMOE_CUDA_INCLUDE at them, so that
# NVRTC can compile the kernels for sm_90a and sm_100a on a machine without a GPU.
deps="$PWD/target/pydeps"
if [ ! -d "$deps/nvidia/cuda_nvrtc" ] || [ ! -d "$deps/nvidia/cuda_runtime" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$deps" \
    "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    || echo "warning: could not install the NVRTC wheels; kernel compile checks will be skipped" >&2
fi
nvrtc_lib=$(dirname "$(find "$deps/nvidia" -name 'libnvrtc.so*' 2>/dev/null | head -1)" 2>/dev/null || true)
if [ -n "$nvrtc_lib" ] && [ -d "$nvrtc_lib" ]; then
  export MEGAMOE_NVRTC_LIB_DIR="$nvrtc_lib"
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
inc=$(find "$deps/nvidia" -path '*cuda_runtime/include' -type d 2>/dev/null | head -1)
[ -n "$inc" ] && export MEGAMOE_CUDA_INCLUDE="$inc"
true
