// The pairs of a call grouped by expert, its input vectors, and the output's last step: shared by the kernel's
// two schedules (kernel.cpp's rows, forward_blocks.h's blocks).

#pragma once

#include "layout.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace moe_dispatch_native {

struct Routing {
  int64_t tokens = 0, top_k = 0, pairs = 0;
  bool on_input = false;
  const float* w = nullptr;         // router weights [T, K]
  std::vector<int64_t> start;       // [E + 1]: expert e's pairs are order[start[e], start[e + 1])
  std::vector<int64_t> order;       // pair indices, expert by expert, each expert's in order
  std::vector<int64_t> active;      // experts with at least one pair
  // The input vector a pair reads: its own (router weight on the input) or its token's.
  int64_t source(int64_t p) const { return on_input ? p : p / top_k; }
  int64_t sources() const { return on_input ? pairs : tokens; }
};

// ids int32 [T, K], tw float32 [T, K], both checked by the caller. Every id is checked
// before any weight is read: an id out of range never indexes anything.
inline Routing route(const at::Tensor& tw, const at::Tensor& ids, int64_t experts, bool on_input) {
  Routing r;
  r.tokens = ids.size(0), r.top_k = ids.size(1), r.pairs = r.tokens * r.top_k;
  r.on_input = on_input;
  r.w = tw.const_data_ptr<float>();
  const int32_t* id = ids.const_data_ptr<int32_t>();
  for (int64_t p = 0; p < r.pairs; ++p)
    if (id[p] < 0 || id[p] >= experts)
      throw std::out_of_range("topk_id value " + std::to_string(id[p]) + " is outside [0, " +
                              std::to_string(experts) + ")");
  r.start.assign(experts + 1, 0);
  r.order.resize(r.pairs);
  for (int64_t p = 0; p < r.pairs; ++p) ++r.start[id[p] + 1];
  for (int64_t e = 0; e < experts; ++e) r.start[e + 1] += r.start[e];
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t p = 0; p < r.pairs; ++p) r.order[fill[id[p]]++] = p;
  for (int64_t e = 0; e < experts; ++e)
    if (r.start[e + 1] > r.start[e]) r.active.push_back(e);
  return r;
}

// The input vectors of sources [range.first, range.second) as fp32, each handed to
// set(source, values): its token's x (float32 or bfloat16), times its router weight where
// that goes on the input. Called by one thread of a team for its share.
template <class Set>
void each_input(const Routing& r, const at::Tensor& x, int64_t hidden,
                std::pair<int64_t, int64_t> range, Set set) {
  std::vector<float> row(hidden);
  for (int64_t s = range.first; s < range.second; ++s) {
    const int64_t t = r.on_input ? s / r.top_k : s;
    const float scale = r.on_input ? r.w[s] : 1.f;
    if (x.scalar_type() == at::kBFloat16) {
      const at::BFloat16* v = x.const_data_ptr<at::BFloat16>() + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] = static_cast<float>(v[h]) * scale;
    } else {
      const float* v = x.const_data_ptr<float>() + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] = v[h] * scale;
    }
    set(s, row.data());
  }
}

// Columns [h0, h1) of every token from acc [T, h1 - h0] into out (float32 or bfloat16).
inline void store_columns(const std::vector<float>& acc, at::Tensor& out, int64_t h0, int64_t h1) {
  const int64_t tokens = out.size(0), hidden = out.size(1), width = h1 - h0;
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::BFloat16* out16 = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* out32 = bf16 ? nullptr : out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = h0; h < h1; ++h) {
      const float v = acc[t * width + (h - h0)];
      if (out16) out16[t * hidden + h] = at::BFloat16(v);
      else out32[t * hidden + h] = v;
    }
}

}  // namespace moe_dispatch_native
