// The memory's part of a call, without the kernel (benchmarks/bench_ceiling.py): bytes
// [0, sum(sizes)) of a uint8 tensor read with plain loads by the kernel's team, segment after
// segment with a barrier between (as steps 2 and 4 read w13, then w2), each segment split
// into one contiguous range per thread (Team::share, 64-byte lines). Returns the seconds the
// team took, timed here (no Python call around it), and the XOR of the bytes' 64-bit words
// (so the loads stay, and a test can see they were read). The benchmark sets each call of
// the kernel against this read of its own active bytes.

#pragma once

#include "team.h"

#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace moe_dispatch_native {

inline std::pair<double, uint64_t> read_steps(const at::Tensor& t, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(t.scalar_type() == at::kByte, "read_steps: a uint8 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.is_cpu() && t.is_contiguous(), "read_steps: a contiguous CPU tensor, got one on ",
              t.device(), t.is_contiguous() ? "" : " (not contiguous)");
  const uint8_t* bytes = t.const_data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(bytes) % 8 == 0,
              "read_steps: data aligned to 8 bytes (a view at an odd offset is not)");
  int64_t total = 0;
  for (const int64_t n : sizes) {
    TORCH_CHECK(n >= 0 && n % 64 == 0, "read_steps: sizes are non-negative multiples of 64 bytes, got ", n);
    TORCH_CHECK(n <= t.numel() - total, "read_steps: more bytes asked than the tensor's ", t.numel());
    total += n;
  }
  const auto* base = reinterpret_cast<const uint64_t*>(bytes);
  std::atomic<uint64_t> fold{0};
  pybind11::gil_scoped_release no_gil;
  const auto t0 = std::chrono::steady_clock::now();
  in_team([&](const Team& team) {
    int64_t offset = 0;  // of the segment
    for (const int64_t n : sizes) {
      team.step([&] {
        const auto [lo, hi] = team.share(n / 64);
        uint64_t acc[8] = {};
        for (const uint64_t *w = base + (offset / 64 + lo) * 8, *end = base + (offset / 64 + hi) * 8; w < end; w += 8)
          for (int l = 0; l < 8; ++l) acc[l] ^= w[l];
        uint64_t mine = 0;
        for (int l = 0; l < 8; ++l) mine ^= acc[l];
        fold.fetch_xor(mine, std::memory_order_relaxed);
      });
      offset += n;
    }
  });
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), fold.load()};
}

}  // namespace moe_dispatch_native
