#!/usr/bin/env bash
# The one prepared GPU run: an H200 lent through the device tool for ~15 minutes in all, one command of at
# most 10 minutes.  Everything runs under one deadline (GPU_CHECK_BUDGET seconds, default 550) so the
# command ends by itself and its logs come back; a step that has no time left is reported as skipped.
#
# Order = value of the answer if the lease ends there:
#   env      what the machine is (GPU, driver, torch, nvcc, cores), so every figure below can be placed
#   build    sm_90 only, forward head dims 64/128, backward 64 (CI's set), one host head dim, no emulator;
#            skipped when .carry/prebuilt/ holds an extension built so on the dev machine from this tree's
#            sources (its commit in .carry/prebuilt/COMMIT, with no change to the build's inputs since) that
#            imports here; a prebuilt of older sources would test old kernels, or fail on Python calling
#            functions its _C lacks
#   smoke    scripts/sanitizer_cases.py without a sanitizer: every forward variant, the backward, split-KV and
#            paged decode once each, against the float64 reference (a crash here explains the tests' failures)
#   tests    pytest -m "cuda and not full" (per-test timeout, failures listed, not stopped at the first)
#   bench    forward against torch SDPA's flash / cuDNN / efficient backends, head dims 64 and 128
#   bwd      forward+backward against the same backends, head dim 64
#   decode   one query row, GQA, KV cache 4k-128k, split-KV
#   decode_trusted  the same at 4k and 16k keys with FLASH_EXT_TRUST_CU_SEQLENS=1 (no per-call index read)
#   device_smoke  when the main extension was prebuilt: the same tree built here, by this image's compilers
#            (a user's path), in the background while the tests run, then the quick sanitizer cases on it
#   baseline the forward and decode on another build, side by side with the main one: whatever
#            .carry/prebuilt_base/ holds (say what in .carry/prebuilt_base/WHAT, printed in the summary: e.g.
#            the commit before a kernel change), else FLASH_EXT_GPU_FWD_WARPS=8 (the 128 x 64, 8-warp tiles before
#            #14's 4-warp and decode tiles) built in the background while the tests run
#   memcheck / racecheck   compute-sanitizer on the quick cases
#   dropout  forward with dropout against SDPA with dropout
#   tests_full  the full forward/backward grid on the GPU, for whatever time is left
# GPU_CHECK_STEPS="smoke tests ..." runs only the named steps (a rerun within the same lease); GPU_CHECK_FULL_TESTS
# names the test files of tests_full.  Logs and JSON go to $WORK and are packed into $OUT/gpu_check.tgz after every step (the device tool returns
# at most 8 files).  Needs CUTLASS headers: carried in .carry/cutlass/include (docs/perf.md) or
# CUTLASS_INCLUDE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
WORK=${GPU_CHECK_WORK:-$(mktemp -d)/gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-550}
mkdir -p "$OUT" "$WORK"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# PYTHONFAULTHANDLER: a crash in the extension prints the Python stack it happened under.
export PATH=$CUDA_HOME/bin:$PATH PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# flash_ext is imported from this checkout (never pip-installed); scripts/*.py need it on the path.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${CUTLASS_INCLUDE_DIR:-}" ] && [ -d .carry/cutlass/include ]; then export CUTLASS_INCLUDE_DIR=$PWD/.carry/cutlass/include; fi
PY=${PY:-python3}
# Python packages the machine's image lacks (expecttest, for torch.library.opcheck) travel as wheels in .whl/.
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
declare -A status
order=()

pack() { tar czf "$OUT/gpu_check.tgz.tmp" -C "$WORK" . 2>/dev/null && mv "$OUT/gpu_check.tgz.tmp" "$OUT/gpu_check.tgz"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
step() {  # name, timeout seconds (cut to what the deadline leaves), command...
  local name=$1 limit=$2; shift 2
  order+=("$name")
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    status[$name]="not asked for (GPU_CHECK_STEPS)"; return 1
  fi
  local avail=$(( $(left) - 15 ))
  (( limit > avail )) && limit=$avail
  if (( limit < 20 )); then status[$name]="skipped (deadline)"; echo "== $name: ${status[$name]}"; return 1; fi
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s)"
  echo "== $name: ${status[$name]}"
  tail -n 4 "$WORK/$name.log"
  pack
  return $rc
}

{
  date -u; git rev-parse --short HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  $PY -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))"
  nvcc --version | tail -2; g++ --version | head -1; nproc; free -g | head -2
  which compute-sanitizer
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

BUILD_ENV=(FLASH_EXT_CUDA_ARCHS=90 FLASH_EXT_HEADDIMS=64,128 FLASH_EXT_BWD_HEADDIMS=64 FLASH_EXT_HOST_HEADDIMS=128
           FLASH_EXT_EMULATOR=0 FLASH_EXT_PTXAS_VERBOSE=1 MAX_JOBS=$JOBS)
# A prebuilt extension (.carry/prebuilt/, built on the dev machine against this image's python and torch with
# BUILD_ENV: docs/perf.md) saves the build's minutes; it is used when it imports, else the tree builds here.
prebuilt=$(ls .carry/prebuilt/_C*.so 2>/dev/null | head -n 1)
used_prebuilt=""
built_from=$(cat .carry/prebuilt/COMMIT 2>/dev/null)
if [ -n "$prebuilt" ] && ! { [ -n "$built_from" ] &&
     git diff --quiet "$built_from" HEAD -- csrc setup.py scripts/cuda_flags.py scripts/gen_instantiations.py &&
     git diff --quiet HEAD -- csrc setup.py; }; then
  echo "prebuilt $prebuilt ignored: built from '${built_from:-unknown}', not this tree's sources" | tee "$WORK/prebuilt.log"
  prebuilt=""
fi
if [ -n "$prebuilt" ] && cp "$prebuilt" flash_ext/ &&
   $PY -c "import flash_ext; print(flash_ext.build_info())" > "$WORK/prebuilt.log" 2>&1; then
  status[build]="prebuilt: $(basename "$prebuilt")"; order+=(build); used_prebuilt=1; cat "$WORK/prebuilt.log"
else
  [ -n "$prebuilt" ] && { rm -f "flash_ext/$(basename "$prebuilt")"; cat "$WORK/prebuilt.log"; }
  step build 330 env "${BUILD_ENV[@]}" $PY setup.py build_ext --inplace || { echo "build failed"; pack; exit 1; }
fi

# Trees built in the background (low priority) while the correctness steps use the GPU: the 8-warp baseline
# (unless prebuilt), and -- when the main extension was prebuilt -- the main tree with this machine's own
# compilers, the path a user's `pip install` takes (a build made here crashed at its first call on
# 2026-12-04 while the same sources built on the dev machine ran: docs/perf.md).  `timeout` leads its own
# process group, so stopping it stops ninja and nvcc too.
declare -A bg_pid bg_dir
asked() { [ -z "${GPU_CHECK_STEPS:-}" ] || [[ " $GPU_CHECK_STEPS " == *" $1 "* ]]; }
bg_build() {  # name, prebuilt folder (may be empty), build environment...
  local name=$1 pre=$2 dir; shift 2
  dir=$(dirname "$WORK")/$name; bg_dir[$name]=$dir
  mkdir -p "$dir" && cp -r csrc flash_ext scripts setup.py pyproject.toml README.md "$dir"/ &&
    ln -s "$PWD/third_party" "$dir/third_party" && rm -f "$dir"/flash_ext/_C*.so
  if [ -n "$pre" ] && ls "$pre"/_C*.so > /dev/null 2>&1; then cp "$pre"/_C*.so "$dir"/flash_ext/; return; fi
  ( cd "$dir" && exec env "$@" MAX_JOBS=$JOBS timeout 400 nice -n 19 $PY setup.py build_ext --inplace \
      > "$WORK/${name}_build.log" 2>&1 ) &
  bg_pid[$name]=$!
}
bg_wait() {  # name: at most 60 s more once the foreground steps are done, then stopped
  local name=$1 pid=${bg_pid[$1]:-}
  if [ -n "$pid" ]; then
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  fi
  order+=("${name}_build")
  if ! ls "${bg_dir[$name]}"/flash_ext/_C*.so > /dev/null 2>&1; then status[${name}_build]="not built in time"; return 1; fi
  status[${name}_build]=$([ -z "$pid" ] && echo prebuilt || echo "built in $(( $(date +%s) - bg_t0 ))s or less")
}
bg_t0=$(date +%s)
asked tiles_old && bg_build base .carry/prebuilt_base FLASH_EXT_GPU_FWD_WARPS=8 FLASH_EXT_CUDA_ARCHS=90 \
  FLASH_EXT_HEADDIMS=64,128 FLASH_EXT_BWD_HEADDIMS=none FLASH_EXT_HOST_HEADDIMS=64 FLASH_EXT_EMULATOR=0
[ -n "$used_prebuilt" ] && asked device_smoke && bg_build device "" "${BUILD_ENV[@]}"

step smoke 60 $PY scripts/sanitizer_cases.py
TIMEOUT_ARG=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=60")
step tests 200 $PY -m pytest -q -m "cuda and not full" -p no:cacheprovider -rfE --maxfail=40 $TIMEOUT_ARG tests
if [ -n "${bg_dir[device]:-}" ] && bg_wait device; then
  # The device tree first on the path: PYTHONPATH holds this checkout, whose flash_ext is the prebuilt one.
  step device_smoke 60 bash -c "cd '${bg_dir[device]}' && export PYTHONPATH='${bg_dir[device]}':\$PYTHONPATH &&
    $PY -c 'import flash_ext; print(flash_ext.__file__)' && $PY scripts/sanitizer_cases.py --quick"
fi
[ -n "${bg_dir[base]:-}" ] && bg_wait base
BASE=${bg_dir[base]:-/nonexistent}
FWD=(--device cuda --no-naive --backends flash cudnn efficient)
step bench 100 $PY -m flash_ext.bench "${FWD[@]}" --headdims 64 128 --json "$WORK/bench.json"
step bwd 90 $PY -m flash_ext.bench fwd+bwd --device cuda --backends flash cudnn efficient --no-naive \
  --headdims 64 --seqlens 1024 4096 16384 --json "$WORK/bench_bwd.json"
step decode 50 $PY -m flash_ext.bench decode --device cuda --json "$WORK/decode.json"
# The same steps with the index values trusted: the difference is the per-call device-to-host read of
# cache_seqlens (one synchronisation per call), which flash_attn does not make.  The bench times each call
# between CUDA events after a synchronisation, so a call's host work counts (short caches: 2026-12-04's
# 0.25 of the read bandwidth at 4096 keys).
step decode_trusted 30 env FLASH_EXT_TRUST_CU_SEQLENS=1 $PY -m flash_ext.bench decode --device cuda \
  --seqlens 4096 16384 --json "$WORK/decode_trusted.json"
if ls "$BASE"/flash_ext/_C*.so > /dev/null 2>&1; then
  # From inside the baseline tree: `python -m` puts the working directory first on sys.path.
  step tiles_old 80 bash -c "cd '$BASE' && $PY -m flash_ext.bench ${FWD[*]} --headdims 64 128 --json '$WORK/tiles_old.json'"
  step decode_old 40 bash -c "cd '$BASE' && $PY -m flash_ext.bench decode --device cuda --json '$WORK/decode_old.json'"
fi
step memcheck 90 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 $PY scripts/sanitizer_cases.py
step racecheck 60 compute-sanitizer --tool racecheck --error-exitcode 9 $PY scripts/sanitizer_cases.py --quick
step dropout 40 $PY -m flash_ext.bench dropout --device cuda --quick --headdims 64 128 --json "$WORK/dropout.json"
# Whatever time is left: the full forward/backward grid on the GPU (-m full), stopped at the deadline.
step tests_full 400 $PY -m pytest -q -m "cuda and full" -p no:cacheprovider -rfE --maxfail=40 $TIMEOUT_ARG \
  ${GPU_CHECK_FULL_TESTS:-tests/test_fwd.py tests/test_bwd.py}

{
  echo "== summary ($COMMIT, $(sed -n 2p "$WORK/env.txt" 2>/dev/null), $(( $(date +%s) - start )) s)"
  for s in "${order[@]}"; do printf '%-10s %s\n' "$s" "${status[$s]:-not run}"; done
  [ -f .carry/prebuilt/WHAT ] && echo "main build: $(head -c 300 .carry/prebuilt/WHAT)"
  [ -f .carry/prebuilt_base/WHAT ] && echo "baseline build: $(head -c 300 .carry/prebuilt_base/WHAT)"
  grep -h -o '"gpu_fwd_warps": *[^,]*' "$WORK"/bench.json "$WORK"/tiles_old.json 2>/dev/null
  grep -E "passed|failed|error" "$WORK/tests.log" | tail -n 3
  grep -E "^(FAILED|ERROR)" "$WORK/tests.log" | head -n 25
  grep -E "passed|failed|error" "$WORK/tests_full.log" 2>/dev/null | tail -n 2
  for f in bench bwd decode decode_trusted tiles_old decode_old dropout; do
    [ -f "$WORK/$f.log" ] && { echo "-- $f"; grep -v -E "^\s*$" "$WORK/$f.log" | tail -n 28; }
  done
} > "$WORK/summary.txt" 2>&1
pack
echo; cat "$WORK/summary.txt"
