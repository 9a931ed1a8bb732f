#!/usr/bin/env bash
# The sm_90a compile tests (registers, spills, wgmma serialization) under the H200 image's NVRTC,
# on a machine without a GPU. ptxas of NVRTC 13.0 (the H200's) spills where 13.5's does not
# (docs/cupy.md, "Compile check"), so CI compiles the wgmma kernels with both.
#
#   bash tools/nvrtc_h200_check.sh          # NVRTC_VERSION (13.0.88) into NVRTC_DIR (.nvrtc-<version>)
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${NVRTC_VERSION:-13.0.88}
DIR=$(realpath -m "${NVRTC_DIR:-.nvrtc-$VER}")
LIB=$DIR/nvidia/cu13/lib
[[ -f $LIB/libnvrtc.so.13 ]] || python -m pip install -q --target "$DIR" "nvidia-cuda-nvrtc==$VER"
# cuda.bindings loads libnvrtc.so.13 by name; the preloaded one answers it, and its builtins come
# from the same folder
export LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} LD_PRELOAD=$LIB/libnvrtc.so.13
got=$(python -c "from portattn.backends.cupy import sm90a; print('.'.join(map(str, sm90a.nvrtc_binding().version())))")
if [[ $got != "${VER%.*}" ]]; then
  echo "NVRTC $got loaded where ${VER%.*} was asked for: the check would not test the H200's compiler" >&2
  exit 1
fi
echo "== NVRTC $got (the H200 image's): the sm_90a compile tests"
# the tests marked sm90a_compile (pyproject.toml); pytest exits 5 when none is selected
python -m pytest -q -n 2 -m sm90a_compile tests/
