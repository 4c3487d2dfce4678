// Enables, for the rest of a per-level translation unit (csrc/host/isa_<level>.cpp), the instructions
// named by FLASH_EXT_ISA_TARGET (a GCC/Clang target string such as "avx2,fma,f16c"): every function
// defined afterwards, including the micro-kernel templates instantiated there, is compiled for that level,
// whatever -march the rest of the build uses.  Include it before any other header of the unit.
#pragma once

#if !defined(FLASH_EXT_ISA_TARGET)
#error "define FLASH_EXT_ISA_TARGET before including isa/target_begin.h"
#endif

#if defined(__clang__)
#define FLASH_EXT_ISA_PRAGMA(x) _Pragma(#x)
#define FLASH_EXT_ISA_PUSH(t) FLASH_EXT_ISA_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
FLASH_EXT_ISA_PUSH(FLASH_EXT_ISA_TARGET)
#elif defined(__GNUC__)
#define FLASH_EXT_ISA_PRAGMA(x) _Pragma(#x)
#define FLASH_EXT_ISA_PUSH(t) FLASH_EXT_ISA_PRAGMA(GCC target(t))
FLASH_EXT_ISA_PUSH(FLASH_EXT_ISA_TARGET)
#else
#error "the per-level micro-kernels need GCC or Clang (target attributes, vector extensions)"
#endif
