// Step 2's block loop alone (benchmarks/bench_stream.py): the pair dot products of one input
// over every pair of w13's blocks of experts [first, first + count), one contiguous share of
// the pairs per thread of the kernel's team, as step 2 reads them at T=1, without routing,
// buffers, activation or barriers. Set against read_steps on the same bytes, it shows what a
// core's streaming loses to the loop itself: on one thread, where a core's own memory
// parallelism is the bound (as when two cores do not saturate the memory), the loop must keep
// as many lines in flight as a plain read does.

#pragma once

#include "blocks_quant.h"
#include "team.h"

#include <chrono>
#include <cmath>
#include <utility>
#include <vector>

namespace moe_dispatch_native {

// (seconds, checksum): the checksum is the sum, pair by pair in order, of the first row of
// each of the pair's two blocks, the same at any thread count.
inline std::pair<double, double> stream_pairs(const BlockProj& p, int64_t experts, int64_t first, int64_t count) {
  TORCH_CHECK(first >= 0 && count >= 1 && first <= experts - count, "stream_w13: experts [first, first + count) "
              "within [0, ", experts, "), got first=", first, ", count=", count);
  const int64_t per_expert = p.blocks / 2, lo = first * per_expert, n = count * per_expert;
  BlockInputs in;
  in.init(1, p.kp, kNarrowGroup, unit_for(p, kNarrowGroup));
  std::vector<float> x(p.kp);
  for (int64_t k = 0; k < p.kp; ++k) x[k] = std::sin(0.37f * static_cast<float>(k) + 1.f);  // never zeros
  in.set(0, x.data(), p.kp);
  std::vector<float> first_rows(n);
  const auto t0 = std::chrono::steady_clock::now();
  in_team([&](const Team& team) {
    team.step([&] {
      const auto [a, b] = team.share(n);
      const int64_t idx[1] = {0};
      float o[2 * kRows];
      for (int64_t i = lo + a; i < lo + b; ++i) {
        pair_dots(p, i / per_expert, 2 * (i % per_expert), in, idx, 1, o);
        first_rows[i - lo] = o[0] + o[kRows];
      }
    });
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double sum = 0;
  for (const float v : first_rows) sum += v;
  return {seconds, sum};
}

}  // namespace moe_dispatch_native
