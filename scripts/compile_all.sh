#!/usr/bin/env bash
# Compiles every forward and backward instantiation (all head dims x fp16/bf16 x causal/not) of the committed
# tree (HEAD) for sm_80 and sm_90 in a scratch build, and regenerates docs/kernels.md from it; fails if any
# kernel spills or uses local memory.  Hours of CPU time with the backward (see docs/kernels.md for the
# per-TU compile times), so CI compiles a subset and this is run after changing tile configs or a kernel body.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/compile-all}
rm -rf "$BUILD" && mkdir -p "$BUILD"
export FLASH_EXT_COMMIT=$(git rev-parse --short HEAD)
git archive HEAD | tar -x -C "$BUILD"
cd "$BUILD"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
FLASH_EXT_CUDA_ARCHS=${FLASH_EXT_CUDA_ARCHS:-"80;90"} FLASH_EXT_HEADDIMS= FLASH_EXT_BWD_HEADDIMS= FLASH_EXT_PTXAS_VERBOSE=1 \
  python setup.py build_ext --inplace > build.log 2>&1 || { tail -n 40 build.log; exit 1; }
python scripts/kernel_report.py flash_ext/_C*.so --out "$OLDPWD/docs/kernels.md" --gate
