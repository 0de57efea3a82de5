// Reading ahead while a thread would otherwise wait. A decode call is bound by its weights'
// bytes, yet the memory sits idle while thread 0 does what only one thread can: routing the
// call and making its buffers and inputs before step 2 (cold code: 5-8 us of a 110-150 us
// call at E=8 top-2 H=1024 I=1408 int4 T=1 on a Zen 5), and while the last thread finishes
// step 2's items. The other threads meanwhile read the first bytes they will stream next, so
// those come from their L2 when their step begins.

#pragma once

#include "blocks_quant.h"
#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace moe_dispatch_native {

// At most this much per thread and wait: within the L2 of the CPUs this project runs on
// (512 KiB on Zen 1 to Zen 3, 1 MiB on Zen 4 and Zen 5), so that what is read is still there.
constexpr int64_t kWarmBytes = 384 * 1024;

// Reads the lines of [p, p + n) in order, 4 KiB between two looks at `stop`, until it is set
// or `budget` bytes are read; returns the bytes read. Plain loads (a line's first word): the
// hardware prefetchers follow them as they follow the kernel's stream.
inline int64_t warm_lines(const uint8_t* p, int64_t n, int64_t budget, const std::atomic<bool>& stop) {
  n = std::min(n, budget);
  uint64_t fold = 0;
  int64_t done = 0;
  while (done < n && !stop.load(std::memory_order_relaxed)) {
    const int64_t end = std::min(n, done + 4096);
    for (; done < end; done += 64) fold ^= *reinterpret_cast<const volatile uint64_t*>(p + done);
  }
  asm volatile("" : : "r"(fold));  // the loads stay
  return done;
}

// What thread `team.id` reads first in step 2 of a blocks call: its share of the items
// (active expert, pair of w13's blocks), in order, until `stop`. Taken from the ids
// themselves, not from the call's Routing, which thread 0 is making meanwhile: the distinct
// ids in [0, experts) ascending are its active experts (an id out of range is read for
// nothing; route() rejects the call).
inline void warm_gate_up(const BlockProj& w13, const int32_t* ids, int64_t n, int64_t experts,
                         const Team& team, const std::atomic<bool>& stop) {
  std::vector<bool> seen(experts);
  for (int64_t p = 0; p < n; ++p)
    if (ids[p] >= 0 && ids[p] < experts) seen[ids[p]] = true;
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (seen[e]) active.push_back(e);
  const int64_t jb = w13.blocks / 2;
  const auto [lo, hi] = team.share(static_cast<int64_t>(active.size()) * jb);
  int64_t budget = kWarmBytes;
  for (int64_t i = lo; i < hi && budget > 0 && !stop.load(std::memory_order_relaxed);) {
    const int64_t e = active[i / jb], j = i % jb, last = std::min(hi, (i / jb + 1) * jb);
    budget -= warm_lines(w13.pair(e, 2 * j), (last - i) * w13.pair_bytes, budget, stop);
    i = last;
  }
}

// What thread `team.id` reads first in step 4: its pairs of the first active expert's w2.
inline void warm_down(const BlockProj& w2, int64_t first_expert, const Team& team,
                      const std::atomic<bool>& stop) {
  const auto [lo2, hi2] = team.share(w2.blocks / 2);
  if (hi2 > lo2) warm_lines(w2.pair(first_expert, 2 * lo2), (hi2 - lo2) * w2.pair_bytes, kWarmBytes, stop);
}

}  // namespace moe_dispatch_native
