// Dropout in the op layer: the argument rules, where the Philox seed and offset of a launch come from (the
// default generator of q's device, or an rng_state input), and the rng_state output.  The mask itself is
// defined in csrc/flash_ext/dropout.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "common.h"
#include "flash_ext/params.h"

namespace flash_ext::ops {

// dropout_p in [0, 1 - 2^-17] (flash_attn 2.8 refuses 1 too); an rng_state input is int64 (2,) on `device`.
// reads_state: the caller reads rng_state even without dropout (dropout_mask); else an empty rng_state is
// taken with dropout_p == 0.
void check_dropout(ArgChecker& c, at::Device device, double dropout_p, std::optional<at::Tensor> const& rng_state,
                   bool reads_state = false);

// What a launch with dropout keeps alive: the rng_state output (the kernel writes the (seed, offset) it used
// into it) and the rng_state input it reads.
struct DropoutState {
  at::Tensor out, in;
};

// The dropout fields of params for one launch; without dropout, only an empty rng_state output.  Draws from
// the default generator (under its mutex) unless rng_state is given: call it last before the launch, after
// every check, so that a refused call advances no generator.
DropoutState set_dropout(FwdParams& p, at::Tensor const& q, double dropout_p,
                         std::optional<at::Tensor> const& rng_state);

// The rng_state output of a call that launches nothing (an empty problem): empty without dropout, else the
// input or (0, 0); no generator is advanced.
at::Tensor idle_rng_state(at::Tensor const& q, double dropout_p, std::optional<at::Tensor> const& rng_state);

}  // namespace flash_ext::ops
