"""Build flash_ext: the torch extension flash_ext._C (CPU backend always, CUDA kernels when possible).

Knobs (environment variables):
  FLASH_EXT_CUDA_ARCHS      CUDA archs to compile, ";"-separated, e.g. "80;90" or "90a".  Unset: the archs of
                            TORCH_CUDA_ARCH_LIST when set (entries below 8.0 dropped, one SASS per major: "8.0 8.6
                            8.9" compiles sm_80 once, which runs on all three), else those of the GPUs the build
                            sees (sm_80 for 8.x, sm_90 for 9.0), else "80;90".  Every arch is one more compile of
                            every CUDA unit: on a machine with its GPU, half the CUDA compile of "80;90".
  FLASH_EXT_HEADDIMS        GPU head dims to instantiate, ","-separated subset of 32,64,96,128,192,256 (default all).
  FLASH_EXT_BWD_HEADDIMS    GPU head dims of the backward kernels, same form (default: FLASH_EXT_HEADDIMS; "none":
                            no CUDA backward, CUDA gradients are then refused by name).  The backward kernels are
                            the largest of the library (see docs/kernels.md for their compile times).
  FLASH_EXT_HOST_HEADDIMS   CPU-backend head dims to instantiate, same form (default all); a problem runs the
                            smallest compiled head dim >= its own, so "256" alone serves every head dim.
  FLASH_EXT_FORCE_CPU_ONLY  "1": build only the CPU backend even when torch and nvcc have CUDA.
  FLASH_EXT_EMULATOR        "1": also build the warp emulator's Sm80 backend (csrc/emu/; off by default, on in CI):
                            under FLASH_EXT_EMULATE=sm80 or flash_ext.emulate("sm80"), CPU fp16/bf16 calls run
                            the real Sm80 kernels on emulated warps, with race/address/bank checks.
  FLASH_EXT_EMU_HEADDIMS    head dims compiled into the emulator (default: FLASH_EXT_HEADDIMS, else all).
  FLASH_EXT_CPU_ARCH        -march for the whole extension (default: none, the compiler's baseline, so that the build
                            runs on any CPU of its architecture; the CPU backend's micro-kernels are compiled for
                            every x86-64 level anyway and chosen at run time, see csrc/flash_ext/host_isa.h).
                            "native" ties the build to CPUs like the build machine's (SIGILL elsewhere).
  FLASH_EXT_GPU_FWD_WARPS   "8": every forward variant on 8 warps x 16 rows (the tiles before dispatch.h gave the
                            lean variants 4 warps x 32 rows): a baseline build to benchmark side by side with a
                            default one (scripts/gpu_check.sh); unset (default): dispatch.h's warps per variant.
  FLASH_EXT_DEBUG_INFO      "1": keep the C++ debug information Python's own compiler flags ask for (-g).  Default:
                            -g0 for the C++ units (host, emulator, op layer), whose CuTe templates make DWARF the
                            dominant cost: measured on one host unit, 119 -> 55 s and 4.2 -> 2.3 GB of compiler
                            memory, a 100 MB -> 0.3 MB object (docs/design.md, "Build cost").  The CUDA units
                            keep -lineinfo either way (torch passes Python's -g to the C++ compiler only).
  FLASH_EXT_PTXAS_VERBOSE   "1": pass -Xptxas=-v (register/spill report per kernel, read by scripts/kernel_report.py).
  CUTLASS_INCLUDE_DIR       CUTLASS/CuTe headers; else third_party/cutlass/include; else pip nvidia-cutlass==4.2.0.0.
  CUDA_HOME                 CUDA toolkit (default /usr/local/cuda when present).
  MAX_JOBS                  parallel compile jobs (default: cores, capped at one job per ~5 GB of free memory).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent
GPU_HEAD_DIMS = (32, 64, 96, 128, 192, 256)

if "CUDA_HOME" not in os.environ and pathlib.Path("/usr/local/cuda/bin/nvcc").exists():
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = "/usr/local/cuda"


def default_max_jobs() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        avail_gb = info.get("MemAvailable", 0) / 2**20
    except OSError:
        avail_gb = 8.0
    return max(1, min(os.cpu_count() or 1, int(avail_gb // 5)))


os.environ.setdefault("MAX_JOBS", str(default_max_jobs()))

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


def load_script(name: str):
    """A helper module of scripts/ (shared with CMake and the tests), loaded without making scripts/ a package."""
    spec = importlib.util.spec_from_file_location(f"flash_ext_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def include_dirs_or_exit() -> list[str]:
    """One implementation of header discovery for setup.py and CMake: scripts/include_dirs.py."""
    mod = load_script("include_dirs")
    try:
        return [str(d) for d in mod.all_includes()]
    except mod.HeaderError as e:
        sys.exit(f"flash_ext: {e}")


def selected_head_dims(var: str = "FLASH_EXT_HEADDIMS", default: list[int] | None = None) -> list[int]:
    raw = os.environ.get(var, "")
    if not raw.strip():
        return list(GPU_HEAD_DIMS) if default is None else default
    if raw.strip().lower() == "none" and var == "FLASH_EXT_BWD_HEADDIMS":
        return []
    dims = sorted({int(x) for x in raw.replace(";", ",").split(",") if x.strip()})
    bad = [d for d in dims if d not in GPU_HEAD_DIMS]
    if bad:
        sys.exit(f"flash_ext: {var}={raw!r} has {bad}; choose from {GPU_HEAD_DIMS}")
    return dims


def head_dims_mask(dims: list[int]) -> int:
    """Bit i set when GPU_HEAD_DIMS[i] (== kGpuHeadDims / kHostHeadDims in C++) is compiled."""
    return sum(1 << GPU_HEAD_DIMS.index(hd) for hd in dims)


def cuda_archs() -> list[str]:
    """FLASH_EXT_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else the visible GPUs, else "80;90" (scripts/cuda_flags.py)."""
    mod = load_script("cuda_flags")
    capabilities: list[tuple[int, int]] = []
    if not os.environ.get("FLASH_EXT_CUDA_ARCHS", "").strip() and not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        try:
            if torch.cuda.is_available():
                capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        except RuntimeError:  # a driver that cannot be initialised: build as if no GPU were there
            capabilities = []
    try:
        archs, source = mod.choose_archs(os.environ, capabilities)
    except mod.ArchError as e:
        sys.exit(f"flash_ext: {e}")
    print(f"flash_ext: CUDA archs {archs} from {source}; each arch is one more compile of every CUDA unit")
    return archs


def heaviest_first(sources: list[pathlib.Path]) -> list[str]:
    """The sources in the order ninja should start them: with no build log (a fresh build, as in CI) ninja
    starts ready compiles in the order they are listed, so a heavy unit listed last would run alone at the
    end while the other jobs idle.  Measured costs (docs/kernels.md): a CUDA backward unit > a CUDA forward
    unit (both per arch) > an emulated Sm80 unit > the host kernel units > the op layer and the rest."""
    def rank(path: pathlib.Path) -> int:
        rel = path.relative_to(ROOT).as_posix()
        for i, prefix in enumerate(("csrc/cuda/generated/bwd_", "csrc/cuda/generated/fwd_", "csrc/emu/generated/",
                                    "csrc/host/fwd_host_", "csrc/host/bwd_host_", "csrc/module.cpp")):
            if rel.startswith(prefix):
                return i
        return 6
    return [str(p.relative_to(ROOT)) for p in sorted(sources, key=lambda p: (rank(p), str(p)))]


def build_extension():
    cuda_home = cpp_extension.CUDA_HOME
    force_cpu = os.environ.get("FLASH_EXT_FORCE_CPU_ONLY", "0") == "1"
    with_cuda = (not force_cpu and torch.version.cuda is not None and cuda_home is not None
                 and (pathlib.Path(cuda_home) / "bin" / "nvcc").exists())

    include_dirs = include_dirs_or_exit()
    cpu_arch = os.environ.get("FLASH_EXT_CPU_ARCH", "")
    # -fopenmp: at::parallel_for is a header template whose OpenMP pragma only takes effect in a TU compiled
    # with OpenMP; without it the CPU backend silently runs on one thread (measured: 0.24x -> see perf.md).
    cxx = ["-O3", "-std=c++20", "-fno-strict-aliasing", "-Wno-unused-variable", "-Wno-unused-but-set-variable",
           "-fopenmp"]
    if cpu_arch:
        cxx.append(f"-march={cpu_arch}")
    # Python's CFLAGS carry -g into every C++ compile (torch puts them before these flags, so -g0 wins).
    if os.environ.get("FLASH_EXT_DEBUG_INFO", "0") != "1":
        cxx.append("-g0")
    fwd_warps = os.environ.get("FLASH_EXT_GPU_FWD_WARPS", "").strip()
    if fwd_warps not in ("", "8"):
        sys.exit(f"flash_ext: FLASH_EXT_GPU_FWD_WARPS={fwd_warps!r}: only \"8\" (the 8-warp baseline tiles) or unset")
    # The module and the emulator report and run the same tiles as the CUDA units: the knob goes to both.
    warps_macro = [f"-DFLASH_EXT_GPU_FWD_WARPS={fwd_warps}"] if fwd_warps else []
    cxx += warps_macro
    # The op layer (one file per op family), the pybind module, and the CPU backend.
    sources = ([ROOT / "csrc" / "module.cpp"] + sorted((ROOT / "csrc" / "ops").glob("*.cpp"))
               + sorted((ROOT / "csrc" / "host").glob("*.cpp")))
    cxx.append(f"-DFLASH_EXT_HOST_HEADDIMS_MASK={head_dims_mask(selected_head_dims('FLASH_EXT_HOST_HEADDIMS'))}")
    if os.environ.get("FLASH_EXT_EMULATOR", "0") == "1":
        var = "FLASH_EXT_EMU_HEADDIMS" if os.environ.get("FLASH_EXT_EMU_HEADDIMS", "").strip() else "FLASH_EXT_HEADDIMS"
        emu_dims = selected_head_dims(var)
        cxx += ["-DFLASH_EXT_WITH_EMULATOR", f"-DFLASH_EXT_EMU_HEADDIMS_MASK={head_dims_mask(emu_dims)}"]
        emu = ROOT / "csrc" / "emu"
        sources += [emu / f for f in ("runtime.cpp", "fiber.cpp", "ptx.cpp", "fwd_emu_dispatch.cpp")]
        sources += sorted(p for p in (emu / "generated").glob("*.cpp")
                          if int(p.name.split("_")[2][len("hdim"):]) in emu_dims)
        print(f"flash_ext: with the warp emulator, emulated head dims {emu_dims}")

    if not with_cuda:
        print("flash_ext: building the CPU backend only "
              f"(torch CUDA: {torch.version.cuda}, CUDA_HOME: {cuda_home}, forced: {force_cpu})")
        return cpp_extension.CppExtension(
            "flash_ext._C", heaviest_first(sources), include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"], py_limited_api=False)

    head_dims = selected_head_dims()
    bwd_head_dims = selected_head_dims("FLASH_EXT_BWD_HEADDIMS", default=head_dims)
    archs = cuda_archs()
    mask = head_dims_mask(head_dims)
    macros = [f"-DFLASH_EXT_WITH_CUDA", f"-DFLASH_EXT_GPU_HEADDIMS_MASK={mask}",
              f"-DFLASH_EXT_GPU_BWD_HEADDIMS_MASK={head_dims_mask(bwd_head_dims)}",
              f'-DFLASH_EXT_CUDA_ARCHS_STR="{";".join(archs)}"']
    gen = ROOT / "csrc" / "cuda" / "generated"
    sources += [ROOT / "csrc" / "cuda" / "fwd_dispatch.cu", ROOT / "csrc" / "cuda" / "dropout_mask.cu",
                ROOT / "csrc" / "cuda" / "bwd_dispatch.cu"]
    # fwd_hdim<hd>_... and bwd_hdim<hd>_... instantiations, each kind for its own head-dim subset.
    kind_dims = {"fwd": head_dims, "bwd": bwd_head_dims}
    sources += sorted(p for p in gen.glob("*.cu")
                      if int(p.name.split("_")[1][len("hdim"):]) in kind_dims[p.name.split("_")[0]])
    nvcc = ["-O3", "-std=c++20", "--use_fast_math", "--expt-relaxed-constexpr", "-lineinfo",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-diag-suppress=177"]
    if os.environ.get("FLASH_EXT_PTXAS_VERBOSE", "0") == "1":
        nvcc.append("-Xptxas=-v")
    nvcc += load_script("cuda_flags").gencode_flags(archs)  # SASS per arch + PTX of the newest (see the script)
    print(f"flash_ext: CUDA build, archs {archs}, GPU head dims {head_dims} (backward {bwd_head_dims}), MAX_JOBS {os.environ['MAX_JOBS']}")
    return cpp_extension.CUDAExtension(
        "flash_ext._C", heaviest_first(sources), include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + macros, "nvcc": nvcc + macros + warps_macro}, extra_link_args=["-fopenmp"],
        py_limited_api=False)


setup(
    ext_modules=[build_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
