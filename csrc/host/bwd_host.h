// One CPU translation unit per dtype instantiates the host backward for every host head dim.
#pragma once

#include <ATen/Parallel.h>

#include "flash_ext/launch_host_bwd.h"

namespace flash_ext {

template <class Element>
void run_bwd_cpu_dtype(BwdParams const& params) {
  run_bwd_host<Element>(params, [](int64_t begin, int64_t end, auto&& body) {
    at::parallel_for(begin, end, /*grain_size=*/1, body);
  });
}

}  // namespace flash_ext
