# Sourced by scripts: installs (once, into target/pydeps) the PyPI wheels nvidia-cuda-nvrtc and
# nvidia-cuda-runtime, and points MEGAMOE_NVRTC_LIB_DIR / MEGAMOE_CUDA_INCLUDE at them, so that
# NVRTC can compile the kernels for sm_90a and sm_100a on a machine without a GPU.
# Wheel layouts differ between releases (CUDA 12: nvidia/cuda_nvrtc/lib, CUDA 13: nvidia/cu13/lib),
# so the library and the headers are found by name.
deps="$PWD/target/pydeps"
find_nvrtc() { find "$deps/nvidia" -name 'libnvrtc.so*' ! -name '*alt*' 2>/dev/null | sort | head -1; }
if [ -z "$(find_nvrtc)" ] || [ -z "$(find "$deps/nvidia" -name cuda_runtime.h 2>/dev/null | head -1)" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$deps" \
    "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    || echo "warning: could not install the NVRTC wheels; kernel compile checks will be skipped" >&2
fi
nvrtc_so=$(find_nvrtc)
if [ -n "$nvrtc_so" ]; then
  nvrtc_lib=$(dirname "$nvrtc_so")
  export MEGAMOE_NVRTC_LIB_DIR="$nvrtc_lib"
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
hdr=$(find "$deps/nvidia" -name cuda_runtime.h 2>/dev/null | head -1)
[ -n "$hdr" ] && export MEGAMOE_CUDA_INCLUDE="$(dirname "$hdr")"
true
