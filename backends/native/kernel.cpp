// moe-dispatch's own fused MoE decode kernel (the "native" backend; docs/architecture.md,
// "The native decode kernel"). Built twice by kernel.py, each build for one ISA:
//   avx2:   -mavx2 -mfma -mf16c                       (every x86 CPU this project runs on)
//   avx512: the above plus AVX-512 F/BW/VL/VNNI/BF16  (Zen 4 and newer, Sapphire Rapids...)
// and the build to load is chosen from the machine's Capabilities, never -march=native.
//
// Decode streams each active expert's weights once per call, so it is bound by memory
// bandwidth if the arithmetic keeps up. The schedule that does:
//   1. inputs: each token's x (scaled by its router weight when that goes on the input)
//      into the dot product's layout: for bf16 weights bf16 (AVX512-BF16) or interleaved fp32
//      (AVX2); for int8/int4 weights int8 blocks of 32 with one fp32 scale each (quantized on
//      the fly, as llama.cpp does: the integer dot product is what keeps up with DRAM on AVX2);
//   2. w13 and the activation, fused: work items are (expert, block of 16 intermediate
//      units); each computes the gate and up rows of its units for every token routed to
//      the expert and writes the activated values. Items are split into one contiguous
//      range per thread, so every core streams its own part of every expert at once;
//   3. the activated values into the layout of step 1 (tiny: T*K*I values);
//   4. w2 and the weighted combine, fused: each thread owns a contiguous range of output
//      columns, reads those rows of every active expert's w2 (expert by expert: one long
//      stream each), and adds each pair's weighted contribution. No atomics, no reduction.
// The intermediate (T*K*2I floats) never leaves the caches.
//
// Weight layouts (packed by _pack.py at prepare(); the reduction axis padded to 32 with
// zeros, which the zero-padded inputs make exact):
//   bf16: [E, N, Kp] uint16 as stored;
//   int8: [E, N, Kp] int8; value = q * scale;
//   int4: [E, N, Kp/2] uint8; in each block of 32 values byte j holds value j in its low
//         nibble and value j + 16 in its high one; value = (u - zero) * scale, u in 0..15;
//   scales: fp32 [E, N, 1] (one per row) or fp16 [E, N, groups] (one per group of
//   32 * blocks_per_group values); zeros: uint8 [E, N, groups], or one constant offset.
// The integer block dot is exact: sum(u * xq) - zero * sum(xq), in int32.


#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <moe_dispatch_fast_call.h>

#include "dots.h"

namespace {

namespace py = pybind11;
// Token counts above which int8 / int4 calls use the tiles of tiles_quant.h (avx512 build):
// at C2 (E=64, K=8, H=2048, I=768) on a Zen 4 int8 T=16 took 9.8 ms in the block-of-32
// loop and 11.2 in the tiles, T=32 15.3 and 13.2 (int4 g128: 7.0 / 7.8, 17.6 / 10.0).
constexpr int64_t kLoopTokens = 16;
constexpr int64_t kChunk = 16;  // row pairs of w2 per chunk of step 4
using OptTensor = std::optional<at::Tensor>;
using namespace moe_dispatch_native;

class Experts {
 public:
  Experts(int64_t fmt, int64_t act, int64_t experts, int64_t hidden, int64_t inter,
          at::Tensor w13, OptTensor w13_scales, OptTensor w13_zeros, int64_t w13_bpg,
          at::Tensor w2, OptTensor w2_scales, OptTensor w2_zeros, int64_t w2_bpg,
          int64_t offset, OptTensor b13, OptTensor b2)
      : fmt_(fmt), act_(act), experts_(experts), hidden_(hidden), inter_(inter),
        b13_(std::move(b13)), b2_(std::move(b2)) {
    TORCH_CHECK(fmt >= kBf16 && fmt <= kInt4 && act >= kSilu && act <= kSwigluOai, "format/act");
    w13_ = make_proj(fmt, experts, 2 * inter, std::move(w13), std::move(w13_scales), std::move(w13_zeros), w13_bpg, offset);
    w2_ = make_proj(fmt, experts, hidden, std::move(w2), std::move(w2_scales), std::move(w2_zeros), w2_bpg, offset);
    TORCH_CHECK(w13_.kp >= hidden && w2_.kp >= inter, "padded reduction axes");
#if MD_AVX512
    tile_prepare(w13_, fmt, experts);
    tile_prepare(w2_, fmt, experts);
#endif
    for (const OptTensor* b : {&b13_, &b2_})
      TORCH_CHECK(!b->has_value() || ((*b)->scalar_type() == at::kFloat && (*b)->is_contiguous()),
                  "biases: contiguous float32");
  }

  // x [T, H] (float32 or bfloat16, contiguous), tw float32 [T, K], ids int32 [T, K].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids,
                     bool on_input) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "x");
    TORCH_CHECK(tw.scalar_type() == at::kFloat && ids.scalar_type() == at::kInt &&
                tw.is_contiguous() && ids.is_contiguous() && tw.sizes() == ids.sizes() &&
                ids.dim() == 2 && ids.size(0) == x.size(0), "topk_weights / topk_ids");
    const int64_t tokens = x.size(0), top_k = ids.size(1), pairs = tokens * top_k;
    at::Tensor out = at::empty_like(x);
    if (tokens == 0) return out;
    const int32_t* id = ids.const_data_ptr<int32_t>();
    const float* w = tw.const_data_ptr<float>();
    for (int64_t p = 0; p < pairs; ++p)  // before any weight is read: never out of bounds
      if (id[p] < 0 || id[p] >= experts_)
        throw std::out_of_range("topk_id value " + std::to_string(id[p]) + " is outside [0, " +
                                std::to_string(experts_) + ")");
    // Pairs grouped by expert (counting sort): expert order, each expert's pairs in order.
    std::vector<int64_t> start(experts_ + 1, 0), order(pairs);
    for (int64_t p = 0; p < pairs; ++p) ++start[id[p] + 1];
    for (int64_t e = 0; e < experts_; ++e) start[e + 1] += start[e];
    {
      std::vector<int64_t> fill(start.begin(), start.end() - 1);
      for (int64_t p = 0; p < pairs; ++p) order[fill[id[p]]++] = p;
    }
    std::vector<int64_t> active;  // experts with at least one pair
    for (int64_t e = 0; e < experts_; ++e)
      if (start[e + 1] > start[e]) active.push_back(e);
    // 1. inputs: one per token, or one per pair when the router weight goes on the input;
    // above kLoopTokens tokens, for the tiles where they apply (int8 / int4, avx512).
    const bool wide = w13_.unit > 0 && w2_.unit > 0 && tokens > kLoopTokens;
    Inputs xin;
    WideInputs xw;
    const int64_t sources = on_input ? pairs : tokens;
    if (wide) xw.init(sources, w13_.kp, fmt_ == kInt4);
    else xin.init(sources, w13_.kp, static_cast<Format>(fmt_), w13_.bpg);
    {
      at::Tensor xf = x.to(at::kFloat).contiguous();
      const float* xs = xf.const_data_ptr<float>();
      // Vectors in parallel, but not bf16 ones (their remainder vector is allocated lazily).
      at::parallel_for(0, sources, fmt_ == kBf16 ? sources : 16, [&](int64_t lo, int64_t hi) {
        std::vector<float> row(hidden_);
        for (int64_t s = lo; s < hi; ++s) {
          const int64_t t = on_input ? s / top_k : s;
          const float scale = on_input ? w[s] : 1.f;
          for (int64_t h = 0; h < hidden_; ++h) row[h] = xs[t * hidden_ + h] * scale;
          if (wide) xw.set(s, row.data(), hidden_);
          else xin.set(s, row.data(), hidden_);
        }
      });
    }
    auto source = [&](int64_t p) { return on_input ? p : p / top_k; };
    // 2. w13 and the activation, per (active expert, block of units).
    const int64_t ip = w2_.kp, blocks = (inter_ + kUnits - 1) / kUnits;
    std::vector<float> act(pairs * ip, 0.f);
    const float* b13 = b13_ ? b13_->const_data_ptr<float>() : nullptr;
    at::parallel_for(0, static_cast<int64_t>(active.size()) * blocks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> gate, up;  // [pairs of the expert, kUnits]
      std::vector<float> sx(xw.groups * kTile8);  // a tile's input scales (wide inputs)
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t e = active[item / blocks], u0 = (item % blocks) * kUnits;
        const int64_t u1 = std::min(inter_, u0 + kUnits), n = start[e + 1] - start[e];
        gate.resize(n * kUnits);
        up.resize(n * kUnits);
        // The expert's pairs kTile at a time, each tile's inputs reused from L1 by the
        // item's rows (read from memory by the first tile, from L2 by the next ones).
        for (int64_t j = 0; j < n; j += kTile) {
          const int64_t m = std::min(kTile, n - j);
          int64_t idx[kTile];
          for (int64_t q = 0; q < m; ++q) idx[q] = source(order[start[e] + j + q]);
          if (wide) xw.gather(idx, m, sx.data());
          for (int64_t u = u0; u < u1; ++u) {
            // Canonical rows: gate u and up I + u; interleaved (swigluoai): 2u and 2u + 1.
            const int64_t rg = act_ == kSwigluOai ? 2 * u : u;
            const int64_t ru = act_ == kSwigluOai ? 2 * u + 1 : inter_ + u;
            const float bg = b13 ? b13[e * 2 * inter_ + rg] : 0.f, bu = b13 ? b13[e * 2 * inter_ + ru] : 0.f;
            float o[2 * kTile];
            rows_dots(fmt_, w13_, e, rg, ru, xin, xw, idx, m, sx.data(), o);
            for (int64_t q = 0; q < m; ++q) {
              gate[(j + q) * kUnits + u - u0] = o[2 * q] + bg;
              up[(j + q) * kUnits + u - u0] = o[2 * q + 1] + bu;
            }
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          float* a = act.data() + order[start[e] + j] * ip;
          activate_units(act_, gate.data() + j * kUnits, up.data() + j * kUnits, a + u0, u1 - u0);
        }
      }
    });
    // 3. the activated values in the dot product's layout.
    Inputs ain;
    WideInputs aw;
    if (wide) aw.init(pairs, ip, fmt_ == kInt4);
    else ain.init(pairs, ip, static_cast<Format>(fmt_), w2_.bpg);
    at::parallel_for(0, pairs, fmt_ == kBf16 ? pairs : 16, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        if (wide) aw.set(p, act.data() + p * ip, inter_);
        else ain.set(p, act.data() + p * ip, inter_);
      }
    });
    // 4. w2 and the weighted combine, per block of output columns (each thread owns its own).
    const int64_t cols = (hidden_ + kCols - 1) / kCols;
    const float* b2 = b2_ ? b2_->const_data_ptr<float>() : nullptr;
    const bool bf16_out = x.scalar_type() == at::kBFloat16;
    at::BFloat16* out16 = bf16_out ? out.data_ptr<at::BFloat16>() : nullptr;
    float* out32 = bf16_out ? nullptr : out.data_ptr<float>();
    at::parallel_for(0, cols, 1, [&](int64_t lo, int64_t hi) {
      // This thread's columns [h0, h1): expert by expert, so that each expert's rows are
      // one contiguous stream (h1 - h0 rows of w2[e]) for the prefetcher.
      const int64_t h0 = lo * kCols, h1 = std::min(hidden_, hi * kCols), width = h1 - h0;
      std::vector<float> acc(tokens * width, 0.f);
      std::vector<float> sx(aw.groups * kTile8);  // a tile's input scales (wide inputs)
      for (const int64_t e : active) {
        // Two rows at once, h and h + half: two streams per thread, as in step 2 (the
        // middle row of an odd range is computed twice and kept once).
        const int64_t half = (width + 1) / 2;
        // Rows in chunks of kChunk pairs (in L2 after the first tile), and within a chunk
        // the expert's pairs kTile at a time (in L1); each output still sums its pairs in order.
        for (int64_t c0 = h0; c0 < h0 + half; c0 += kChunk) {
          const int64_t c1 = std::min(h0 + half, c0 + kChunk);
          for (int64_t slot = start[e]; slot < start[e + 1]; slot += kTile) {
            const int64_t m = std::min(kTile, start[e + 1] - slot);
            if (wide) aw.gather(order.data() + slot, m, sx.data());
            for (int64_t h = c0; h < c1; ++h) {
              const int64_t h2 = h + half < h1 ? h + half : h;
              const float bias0 = b2 ? b2[e * hidden_ + h] : 0.f, bias1 = b2 ? b2[e * hidden_ + h2] : 0.f;
              float o[2 * kTile];
              rows_dots(fmt_, w2_, e, h, h2, ain, aw, order.data() + slot, m, sx.data(), o);
              for (int64_t q = 0; q < m; ++q) {
                const int64_t p = order[slot + q];
                const float scale = on_input ? 1.f : w[p];
                float* a = acc.data() + (p / top_k) * width - h0;
                a[h] += scale * (o[2 * q] + bias0);
                if (h2 != h) a[h2] += scale * (o[2 * q + 1] + bias1);
              }
            }
          }
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = h0; h < h1; ++h) {
          const float v = acc[t * width + (h - h0)];
          if (out16) out16[t * hidden_ + h] = at::BFloat16(v);
          else out32[t * hidden_ + h] = v;
        }
      }
    });
    return out;
  }

 private:
  int64_t fmt_, act_, experts_, hidden_, inter_;
  Proj w13_, w2_;
  OptTensor b13_, b2_;
};

// The layer's plain calls (BackendBase.fast_call): the toolkit's checks, then forward.
class FastCall {
 public:
  FastCall(std::shared_ptr<Experts> experts, bool on_input, int64_t hidden, int64_t top_k,
           int64_t n_experts, at::ScalarType dtype, std::vector<at::Tensor> watched,
           std::vector<int64_t> versions)
      : experts_(std::move(experts)), on_input_(on_input),
        spec_(hidden, top_k, n_experts, dtype, std::move(watched), std::move(versions)) {}

  py::object operator()(py::handle x, py::handle tw, py::handle ids) const {
    const std::optional<moe_dispatch::PlainCall> call = moe_dispatch::PlainCall::check(spec_, x, tw, ids);
    if (!call) return py::none();
    at::Tensor out;
    {
      py::gil_scoped_release no_gil;
      out = experts_->forward(*call->x, *call->topk_weights, *call->topk_ids, on_input_);
    }
    return moe_dispatch::wrap(std::move(out));
  }

 private:
  std::shared_ptr<Experts> experts_;
  bool on_input_;
  moe_dispatch::PlainSpec spec_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-dispatch: the native backend's fused MoE decode kernel";
  m.attr("ISA") = kIsa;
  m.attr("LANES") = kLanes;
  py::class_<Experts, std::shared_ptr<Experts>>(m, "Experts")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::Tensor, OptTensor, OptTensor,
                    int64_t, at::Tensor, OptTensor, OptTensor, int64_t, int64_t, OptTensor,
                    OptTensor>())
      .def("forward", &Experts::forward, py::call_guard<py::gil_scoped_release>());
  py::class_<FastCall>(m, "FastCall")
      .def(py::init<std::shared_ptr<Experts>, bool, int64_t, int64_t, int64_t, at::ScalarType,
                    std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("__call__", &FastCall::operator());
}
