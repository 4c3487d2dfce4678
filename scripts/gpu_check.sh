#!/usr/bin/env bash
# The one prepared GPU run (an H200 lent through the device tool, ~10 minutes): builds for sm_90 only the
# head dims it needs, reports kernel resources, runs the GPU tests, compute-sanitizer memcheck and racecheck
# on small cases (forward and backward), then the forward and forward+backward benchmarks against torch SDPA,
# and last, time allowing, the forward at head dims 64 and 128 and a decode step at head dim 64 on this
# build's tiles next to an 8-warp baseline build (FLASH_EXT_GPU_FWD_WARPS=8: the 128 x 64, 8-warp tiles
# before 4 warps x 32 rows -- 64 keys at head dim 64, 32 keys at 128 -- and before the one-warp decode
# tile).  Full logs go to $OUT (default ./gpu_out); a short table is printed last.  Needs CUTLASS headers: carry them (see docs/perf.md) or set
# CUTLASS_INCLUDE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH PYTHONUNBUFFERED=1
# flash_ext is imported from this checkout (never pip-installed); scripts/*.py need it on the path.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${CUTLASS_INCLUDE_DIR:-}" ] && [ -d .carry/cutlass/include ]; then export CUTLASS_INCLUDE_DIR=$PWD/.carry/cutlass/include; fi
PY=${PY:-python3}
start=$(date +%s)
declare -A status
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  echo "== $name: ${status[$name]}"
  tail -n 5 "$OUT/$name.log"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || echo unknown > "$OUT/commit.txt"

FLASH_EXT_CUDA_ARCHS=90 FLASH_EXT_HEADDIMS=${FLASH_EXT_HEADDIMS:-64,128} MAX_JOBS=${MAX_JOBS:-16} \
  step build 420 $PY setup.py build_ext --inplace || { echo "build failed"; exit 1; }
step kernels 60 $PY scripts/kernel_report.py flash_ext/_C*.so --out "$OUT/kernels.md" --gate
step tests 180 $PY -m pytest -q -x -m "cuda" tests
step memcheck 120 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 $PY scripts/sanitizer_cases.py
step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 9 $PY scripts/sanitizer_cases.py --quick
step bench 120 $PY -m flash_ext.bench --device cuda --json "$OUT/bench.json"
step bench_bwd 150 $PY -m flash_ext.bench fwd+bwd --device cuda --backends flash cudnn efficient --no-naive \
  --seqlens 1024 4096 16384 \
  --json "$OUT/bench_bwd.json"
step decode 90 $PY -m flash_ext.bench decode --device cuda --json "$OUT/decode.json"
step dropout 90 $PY -m flash_ext.bench dropout --device cuda --headdims 64 128 --seqlens 1024 4096 --json "$OUT/dropout.json"

# Old vs new tiles side by side (#14): the same head-dim-64 and -128 forward grid on this build and on a
# baseline build of a copy of the tree (8 warps x 16 rows for every variant; sm_90, head dims 64 and 128, no
# backward, host head dim 64 only, to keep its build short).  Skipped when the steps above already took long.
if (( $(date +%s) - start < 420 )); then
  BASE=$(mktemp -d)/tree
  mkdir -p "$BASE" && cp -r csrc flash_ext scripts setup.py pyproject.toml README.md "$BASE"/ &&
    ln -s "$PWD/third_party" "$BASE/third_party" && rm -f "$BASE"/flash_ext/_C*.so
  FLASH_EXT_GPU_FWD_WARPS=8 FLASH_EXT_CUDA_ARCHS=90 FLASH_EXT_HEADDIMS=64,128 FLASH_EXT_BWD_HEADDIMS=none \
    FLASH_EXT_HOST_HEADDIMS=64 MAX_JOBS=${MAX_JOBS:-16} \
    step baseline_build 240 bash -c "cd '$BASE' && $PY setup.py build_ext --inplace" &&
    step tiles_new 120 $PY -m flash_ext.bench --device cuda --headdims 64 128 --json "$OUT/tiles_new.json" &&
    step tiles_old 120 env PYTHONPATH="$BASE" $PY -m flash_ext.bench --device cuda --headdims 64 128 \
      --json "$OUT/tiles_old.json"
  # Decode (GQA 32/8 heads, head dim 64): the decode tile against the 128-row tile, same splits rule.
  step decode_new 60 $PY -m flash_ext.bench decode --device cuda --headdims 64 --seqlens 8192 65536 \
    --json "$OUT/decode_new.json"
  step decode_old 60 env PYTHONPATH="$BASE" $PY -m flash_ext.bench decode --device cuda --headdims 64 \
    --seqlens 8192 65536 --json "$OUT/decode_old.json"
else
  status[baseline_build]="skipped: $(( $(date +%s) - start )) s already"
fi

echo
echo "== summary ($(cat "$OUT/commit.txt"), $(head -2 "$OUT/gpu.txt" | tail -1))"
for s in build kernels tests memcheck racecheck bench bench_bwd decode dropout baseline_build tiles_new tiles_old \
  decode_new decode_old; do printf '%-10s %s
' "$s" "${status[$s]:-not run}"; done
grep -E "TFLOP|ratio|FAIL" "$OUT/bench.log" | tail -n 30 || true
grep -E "TFLOP|ratio|FAIL" "$OUT/bench_bwd.log" | tail -n 30 || true
tail -n 9 "$OUT/decode.log" || true
tail -n 12 "$OUT/dropout.log" || true
for t in new old; do echo "-- head dim 64, $t tiles"; grep -E "^ *(bf16|fp16) " "$OUT/tiles_$t.log" || true; done
for t in new old; do echo "-- decode, head dim 64, $t tiles"; tail -n 4 "$OUT/decode_$t.log" || true; done
