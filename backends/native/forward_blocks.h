// The schedule for weights in blocks of 16 rows (blocks_quant.h: int8 / int4, both builds):
// kernel.cpp's four steps, with every dot product a block's 16 rows by up to kTile inputs.
//   1. inputs quantized per kNarrowGroup values up to kNarrowTokens tokens (decode: bound by
//      the weights' bytes, so the finer scales cost nothing and keep the error of
//      llama.cpp's blocks of 32), per kWideGroup above (one scaled sum per 128 values, where
//      the GEMM's arithmetic is what counts);
//   2. w13 and the activation: work items (active expert, 16 units) read w13's blocks 2j
//      (gate rows) and 2j + 1 (up rows) once from memory and, from L2, once per tile of the
//      expert's pairs, activating 16 units per pair at once; a thread takes the items in
//      chunks of about 64 KiB of weights, and when its range is done, chunks from the back
//      of another's (team.h, Shares);
//   3. the activated values quantized per kNarrowGroup values at every T: their tails are
//      heavier than x's, and per 128 values they made 2.1e-2 of error at T=64 (H=1024
//      I=512, random weights) where per 32 make 1.3e-2, at no measured cost (w2 is a third
//      of the arithmetic). Tried and left out: each input as two vectors (its values and
//      what they left) up to 16 tokens, which took the error there to the bf16 output's
//      rounding (1.7e-3) but cost C1 (E=8 top-2, 2-4 tokens per expert at T=8-16) up to
//      0.80x of the avx2 rows' time instead of 0.48x, below the decode targets;
//   4. w2 and the weighted combine: each thread owns a range of blocks of output columns,
//      expert by expert, kChunkBlocks blocks at a time (in L2 across the expert's tiles).

#pragma once

#include "activations.h"
#include "blocks_quant.h"
#include "routing.h"
#include "team.h"

#include <moe_dispatch_fast_call.h>  // new_output

namespace moe_dispatch_native {

constexpr int64_t kNarrowTokens = 16;
constexpr int64_t kChunkBlocks = 8;

struct BlockLayer {
  int64_t act = 0, hidden = 0, inter = 0;
  BlockProj w13, w2;
  const float* b13 = nullptr;  // [E, 2I] canonical rows, or null
  const float* b2 = nullptr;   // [E, H], or null
};

// Step 2's item: units u0 .. u0 + 15 of expert e for its pairs, into act [pairs, ip].
inline void gate_up_units(const BlockLayer& L, const Routing& r, const BlockInputs& in,
                          int64_t e, int64_t j, float* act, int64_t ip) {
  const int64_t u0 = j * kRows, units = std::min(kRows, L.inter - u0);
  float bg[kRows] = {}, bu[kRows] = {};
  if (L.b13) {
    for (int64_t l = 0; l < units; ++l) {
      bg[l] = L.b13[e * 2 * L.inter + gate_row(L.act, u0 + l)];
      bu[l] = L.b13[e * 2 * L.inter + up_row(L.act, L.inter, u0 + l)];
    }
  }
  float o[2 * kTile * kRows];
  int64_t idx[kTile];
  for (int64_t slot = r.start[e]; slot < r.start[e + 1]; slot += kTile) {
    const int64_t m = std::min(kTile, r.start[e + 1] - slot);
    for (int64_t q = 0; q < m; ++q) idx[q] = r.source(r.order[slot + q]);
    pair_dots(L.w13, e, 2 * j, in, idx, m, o);
    for (int64_t q = 0; q < m; ++q) {
      float* gate = o + q * kRows;
      float* up = o + (m + q) * kRows;
      for (int64_t l = 0; l < kRows; ++l) gate[l] += bg[l], up[l] += bu[l];
      activate_units(L.act, gate, up, act + r.order[slot + q] * ip + u0, units);
    }
  }
}

// Step 4 for the output blocks [lo, hi): acc [T, columns of those blocks] += each pair's
// router-weighted rows, expert by expert (each output sums its pairs in one fixed order).
inline void down_blocks(const BlockLayer& L, const Routing& r, const BlockInputs& in,
                        int64_t lo, int64_t hi, std::vector<float>& acc) {
  const int64_t h0 = lo * kRows, width = std::min(L.hidden, hi * kRows) - h0;
  float o[2 * kTile * kRows];
  for (const int64_t e : r.active) {
    for (int64_t c0 = lo; c0 < hi; c0 += kChunkBlocks) {
      const int64_t c1 = std::min(hi, c0 + kChunkBlocks);
      for (int64_t slot = r.start[e]; slot < r.start[e + 1]; slot += kTile) {
        const int64_t m = std::min(kTile, r.start[e + 1] - slot);
        for (int64_t b = c0; b < c1; b += 2) {
          pair_dots(L.w2, e, b, in, r.order.data() + slot, m, o);
          for (int64_t rr = 0; rr < 2; ++rr) {
            const int64_t col = (b + rr) * kRows, cols = std::min(kRows, L.hidden - col);
            if (cols <= 0) break;  // the padding block of an odd count
#if MD_AVX512
            const __mmask16 mk = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
            const __m512 bias = L.b2 ? _mm512_maskz_loadu_ps(mk, L.b2 + e * L.hidden + col)
                                     : _mm512_setzero_ps();
            for (int64_t q = 0; q < m; ++q) {
              const int64_t p = r.order[slot + q];
              const __m512 scale = _mm512_set1_ps(r.on_input ? 1.f : r.w[p]);
              float* a = acc.data() + (p / r.top_k) * width + (col - h0);
              const __m512 v = _mm512_add_ps(_mm512_loadu_ps(o + (rr * m + q) * kRows), bias);
              _mm512_mask_storeu_ps(a, mk, _mm512_fmadd_ps(v, scale, _mm512_maskz_loadu_ps(mk, a)));
            }
#else
            for (int64_t q = 0; q < m; ++q) {
              const int64_t p = r.order[slot + q];
              const float scale = r.on_input ? 1.f : r.w[p];
              float* a = acc.data() + (p / r.top_k) * width + (col - h0);
              const float* v = o + (rr * m + q) * kRows;
              for (int64_t l = 0; l < cols; ++l) a[l] += scale * (v[l] + (L.b2 ? L.b2[e * L.hidden + col + l] : 0.f));
            }
#endif
          }
        }
      }
    }
  }
}

inline at::Tensor forward_blocks(const BlockLayer& L, const Routing& r, const at::Tensor& x) {
  at::Tensor out = moe_dispatch::new_output(x);
  const int64_t group = r.tokens > kNarrowTokens ? kWideGroup : kNarrowGroup;
  const int64_t ip = L.w2.kp, jb = L.w13.blocks / 2;
  BlockInputs xin, ain;
  xin.init(r.sources(), L.w13.kp, group, unit_for(L.w13, group));
  ain.init(r.pairs, ip, kNarrowGroup, unit_for(L.w2, kNarrowGroup));
  std::vector<float> act(r.pairs * ip, 0.f);
  Shares items;
  in_team([&](const Team& team) {
    team.step([&] {  // 1. inputs.
      if (team.id == 0)  // an item reads two blocks (chunked by their steps' bytes, as measured: team.h)
        items.init(team, static_cast<int64_t>(r.active.size()) * jb, 2 * L.w13.block_bytes);
      each_input(r, x, L.hidden, team.share(r.sources()),
                 [&](int64_t s, const float* v) { xin.set(s, v, L.hidden); });
    });
    team.step([&] {  // 2. w13 and the activation.
      items.run(team, [&](int64_t item) {
        gate_up_units(L, r, xin, r.active[item / jb], item % jb, act.data(), ip);
      });
    });
    team.step([&] {  // 3. the activated values.
      const auto [p0, p1] = team.share(r.pairs);
      for (int64_t p = p0; p < p1; ++p) ain.set(p, act.data() + p * ip, L.inter);
    });
    team.step([&] {  // 4. w2 and the weighted combine, over this thread's pairs of blocks.
      const auto [lo2, hi2] = team.share(L.w2.blocks / 2);
      const int64_t lo = 2 * lo2, hi = 2 * hi2, h0 = lo * kRows, h1 = std::min(L.hidden, hi * kRows);
      if (h1 <= h0) return;
      std::vector<float> acc(r.tokens * (h1 - h0), 0.f);
      down_blocks(L, r, ain, lo, hi, acc);
      store_columns(acc, out, h0, h1);
    });
  });
  return out;
}

}  // namespace moe_dispatch_native
