// Test-only level: the AMX-BF16 level's micro-kernel source (the tile GEMM, its packing and blocking) on AVX2,
// its tiles emulated in software (host_isa_emulated.cpp says how), so that any x86-64 CPU runs it.
#define FLASH_EXT_EMULATE_TILES 1
#include "host_isa_emulated.cpp"
