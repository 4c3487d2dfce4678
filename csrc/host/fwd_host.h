// One CPU translation unit per dtype instantiates the host backend for every host head dim.
#pragma once

#include <ATen/Parallel.h>

#include "flash_ext/launch_host.h"

namespace flash_ext {

template <class Element>
void run_fwd_cpu_dtype(FwdParams const& params) {
  run_fwd_host<Element>(params, [](int64_t begin, int64_t end, auto&& body) {
    at::parallel_for(begin, end, /*grain_size=*/1, body);
  });
}

}  // namespace flash_ext
