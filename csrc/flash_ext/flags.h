// Specialisation flags of the kernel body.  Each flag is either a compile-time constant (cute::C<true> /
// cute::C<false>) or a runtime `bool`.  The body reads them the same way (`if (flags.causal)`): a constant
// folds the branch away, a runtime bool keeps it.  The GPU instantiates a few static combinations per file
// (dispatch.h says which); the host instance keeps every flag dynamic so that it compiles once per
// (dtype, head dim).
#pragma once

#include <type_traits>

#include <cute/numeric/integral_constant.hpp>

namespace flash_ext {

template <class EvenMN, class EvenK, class Causal, class Local, class Alibi, class Softcap, class Split,
          class Dropout>
struct KernelFlags {
  EvenMN even_mn;   // seqlen_q % kBlockM == 0 and seqlen_k % kBlockN == 0: no row predicates on Q/K/V/O
  EvenK even_k;     // d == kHeadDim: no column predicates, no zero-filled head-dim padding
  Causal causal;    // bottom-right causal mask (window_right = 0, window_left unbounded)
  Local local;      // a finite sliding window (window_left and/or window_right >= 0), not plain causal
  Alibi alibi;      // ALiBi bias
  Softcap softcap;  // score = softcap * tanh(score / softcap)
  Split split;      // split-KV: this CTA handles a share of the K/V tiles and writes fp32 partials
  Dropout dropout;  // dropout on P (dropout.h); a static false leaves no random-number code in the kernel
};

using DynamicFlags = KernelFlags<bool, bool, bool, bool, bool, bool, bool, bool>;

// Whether a flag is off by type (a static false), as opposed to a static true or a runtime value that may be
// false: what a choice of code path needs when it must hold for every call the instance serves.
template <class Flag>
inline constexpr bool kStaticFalse = std::is_same_v<Flag, cute::C<false>>;

// A flag value as the body sees it: the static constant when the flag is static, else the runtime value.
template <class Flag>
constexpr Flag make_flag(bool runtime_value) {
  if constexpr (std::is_same_v<Flag, bool>) {
    return runtime_value;
  } else {
    return Flag{};
  }
}

}  // namespace flash_ext
