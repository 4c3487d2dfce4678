// Test-only level: the plain AVX-512 level's micro-kernel source (16 lanes, no bf16 products: bf16 operands
// widened to fp32, the few-rows GEMMs by bf16 pairs) on AVX2 (host_isa_emulated.cpp says how).
#define FLASH_EXT_EMULATE_NO_BF16_DOT 1
#include "host_isa_emulated.cpp"
