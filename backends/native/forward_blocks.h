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
// Thread 0 routes the call inside the team and makes its buffers; until it is done, the
// other threads read the first bytes of their step-2 items ahead (warm.h). Up to
// kNarrowTokens inputs, thread 0 also makes them then, and the others go on to step 2 without
// a barrier while thread 0 makes the output; a thread done with step 2 early reads the start
// of its step 4 ahead.

#pragma once

#include "activations.h"
#include "blocks_quant.h"
#include "routing.h"
#include "team.h"
#include "warm.h"

#include <moe_dispatch_fast_call.h>  // new_output

#include <atomic>
#include <thread>

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

// x [T, H], tw float32 [T, K], ids int32 [T, K] (checked by the caller; the ids' range here).
// The team starts first and thread 0 routes the call inside it: the others read ahead from
// the ids meanwhile (warm.h).
inline at::Tensor forward_blocks(const BlockLayer& L, const at::Tensor& x, const at::Tensor& tw,
                                 const at::Tensor& ids, int64_t experts, bool on_input) {
  const int64_t tokens = ids.size(0), pairs = ids.numel(), sources = on_input ? pairs : tokens;
  const int64_t group = tokens > kNarrowTokens ? kWideGroup : kNarrowGroup;
  const int64_t ip = L.w2.kp, jb = L.w13.blocks / 2;
  // Up to kNarrowTokens sources, thread 0 quantizes them all right after the buffers (step 1
  // has no share worth a barrier); above, step 1 is split.
  const bool one_filler = sources <= kNarrowTokens;
  Routing r;
  at::Tensor out;
  BlockInputs xin, ain;
  std::vector<float> act;
  Shares items;
  // Polled by the other threads while thread 0 writes beside them: lines of their own.
  alignas(64) std::atomic<bool> ready{false};  // thread 0 has routed and made the buffers
  alignas(64) std::atomic<int> past_gate_up{0};  // threads done with step 2's items
  std::atomic<bool> gate_up_done{false};
  auto fill = [&](std::pair<int64_t, int64_t> share) {
    each_input(r, x, L.hidden, share, [&](int64_t s, const float* v) { xin.set(s, v, L.hidden); });
  };
  auto setup = [&](const Team& team) {  // thread 0: routing, buffers (and the inputs, one_filler)
    try {
      r = route(tw, ids, experts, on_input);
      xin.init(sources, L.w13.kp, group, unit_for(L.w13, group));
      ain.init(pairs, ip, kNarrowGroup, unit_for(L.w2, kNarrowGroup));
      act.assign(pairs * ip, 0.f);
      // an item reads two blocks (chunked by their steps' bytes, as measured: team.h)
      items.init(team, static_cast<int64_t>(r.active.size()) * jb, 2 * L.w13.block_bytes);
      if (one_filler) fill({0, sources});
    } catch (...) {  // (an id out of range): the others see the failure before the flag
      team.failed->store(true, std::memory_order_relaxed);
      ready.store(true, std::memory_order_release);
      throw;
    }
    ready.store(true, std::memory_order_release);
  };
  auto read_ahead = [&](const Team& team) {
    try {  // only ever a head start: a failure here (memory for its list) changes no result
      warm_gate_up(L.w13, ids.const_data_ptr<int32_t>(), pairs, experts, team, ready);
    } catch (...) {
    }
  };
  auto gate_up = [&](const Team& team) {  // step 2's items; a thread done early reads step 4's start
    items.run(team, [&](int64_t item) {
      gate_up_units(L, r, xin, r.active[item / jb], item % jb, act.data(), ip);
    });
    if (past_gate_up.fetch_add(1, std::memory_order_relaxed) + 1 == team.size)
      gate_up_done.store(true, std::memory_order_relaxed);
    else if (!r.active.empty())  // (ids with no columns: no pairs)
      warm_down(L.w2, r.active[0], team, gate_up_done);
  };
  in_team([&](const Team& team) {
    if (one_filler) {
      // 0 to 2 in one step: thread 0 routes, makes the buffers and the inputs, then the
      // output while the others already run step 2's items (which need no output); until
      // the inputs are made they read ahead.
      team.step([&] {
        if (team.id == 0) {
          setup(team);
          out = moe_dispatch::new_output(x);
        } else {
          read_ahead(team);
          // Thread 0 sets the flag however its setup ends; a thread that sees the team failed
          // (thread 0's setup, or nothing: it may not have begun) leaves without reading what
          // setup makes. Past a short spin, the core goes to thread 0 where threads outnumber cores.
          for (int spins = 0; !ready.load(std::memory_order_acquire); ++spins) {
            if (team.failed->load(std::memory_order_relaxed)) return;
            if (spins < 4096) _mm_pause();
            else std::this_thread::yield();
          }
          if (team.failed->load(std::memory_order_relaxed)) return;
        }
        gate_up(team);
      });
    } else {
      team.step([&] {  // 0. routing, the output and buffers, by thread 0; the others read ahead.
        if (team.id != 0) return read_ahead(team);
        setup(team);
        out = moe_dispatch::new_output(x);
      });
      team.step([&] { fill(team.share(sources)); });  // 1. inputs.
      team.step([&] { gate_up(team); });             // 2. w13 and the activation.
    }
    team.step([&] {  // 3. the activated values.
      const auto [p0, p1] = team.share(pairs);
      for (int64_t p = p0; p < p1; ++p) ain.set(p, act.data() + p * ip, L.inter);
    });
    team.step([&] {  // 4. w2 and the weighted combine, over this thread's pairs of blocks.
      const auto [lo2, hi2] = team.share(L.w2.blocks / 2);
      const int64_t lo = 2 * lo2, hi = 2 * hi2, h0 = lo * kRows, h1 = std::min(L.hidden, hi * kRows);
      if (h1 <= h0) return;
      std::vector<float> acc(tokens * (h1 - h0), 0.f);
      down_blocks(L, r, ain, lo, hi, acc);
      store_columns(acc, out, h0, h1);
    });
  });
  return out;
}

}  // namespace moe_dispatch_native
