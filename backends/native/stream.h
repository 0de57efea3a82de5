// Step 2's block loop alone (benchmarks/bench_stream.py): the pair dot products of `inputs`
// inputs (1 to kTile, an expert's tokens at decode) over every pair of w13's blocks of
// experts [first, first + count), one contiguous share of the pairs per thread of the
// kernel's team, as step 2 reads them, without routing, buffers, activation or barriers. Set
// against read_steps on the same bytes, it shows what a core's streaming loses to the loop
// itself: on one thread, where a core's own memory parallelism is the bound (as when two
// cores do not saturate the memory), the loop must keep as many lines in flight as a plain
// read does.

#pragma once

#include "blocks_quant.h"
#include "team.h"

#include <chrono>
#include <cmath>
#include <utility>
#include <vector>

namespace moe_dispatch_native {

// (seconds, checksum): the checksum is the sum, pair by pair in order, of the first row of
// each of the pair's two blocks dotted with the first input, the same at any thread count.
// Input i is sin(0.37 k + 1 + i) at value k (never zeros).
inline std::pair<double, double> stream_pairs(const BlockProj& p, int64_t experts, int64_t first,
                                              int64_t count, int64_t inputs) {
  TORCH_CHECK(first >= 0 && count >= 1 && first <= experts - count,
              "stream_w13: experts [first, first + count) within [0, ", experts, "), got first=", first,
              ", count=", count);
  TORCH_CHECK(inputs >= 1 && inputs <= kTile, "stream_w13: inputs in [1, ", kTile, "], got ", inputs);
  const int64_t per_expert = p.blocks / 2, lo = first * per_expert, n = count * per_expert;
  BlockInputs in;
  in.init(inputs, p.kp, kNarrowGroup, unit_for(p, kNarrowGroup));
  std::vector<float> x(p.kp);
  int64_t idx[kTile];
  for (int64_t i = 0; i < inputs; ++i) {
    for (int64_t k = 0; k < p.kp; ++k)
      x[k] = std::sin(0.37f * static_cast<float>(k) + 1.f + static_cast<float>(i));
    in.set(i, x.data(), p.kp);
    idx[i] = i;
  }
  std::vector<float> first_rows(n);
  const auto t0 = std::chrono::steady_clock::now();
  in_team([&](const Team& team) {
    team.step([&] {
      const auto [a, b] = team.share(n);
      float o[2 * kTile * kRows];
      for (int64_t i = lo + a; i < lo + b; ++i) {
        pair_dots(p, i / per_expert, 2 * (i % per_expert), in, idx, inputs, o);
        first_rows[i - lo] = o[0] + o[inputs * kRows];  // block 2j's row 0, block 2j + 1's, input 0
      }
    });
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double sum = 0;
  for (const float v : first_rows) sum += v;
  return {seconds, sum};
}

}  // namespace moe_dispatch_native
