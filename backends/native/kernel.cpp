// moe-dispatch's own fused MoE decode kernel (the "native" backend; docs/architecture.md,
// "The native decode kernel"). Built twice by kernel.py, each build for one ISA:
//   avx2:   -mavx2 -mfma -mf16c                       (every x86 CPU this project runs on)
//   avx512: the above plus AVX-512 F/BW/VL/VNNI/BF16  (Zen 4 and newer, Sapphire Rapids...)
// and the build to load is chosen from the machine's Capabilities, never -march=native.
//
// Decode streams each active expert's weights once per call, so it is bound by memory
// bandwidth if the arithmetic keeps up. The schedule that does:
//   1. inputs: each token's x (scaled by its router weight when that goes on the input)
//      into the dot product's layout: bf16 (AVX512-BF16) or interleaved fp32 (AVX2);
//   2. w13 and the activation, fused: work items are (expert, block of 16 intermediate
//      units); each computes the gate and up rows of its units for every token routed to
//      the expert and writes the activated values. Items are split into one contiguous
//      range per thread, so every core streams its own experts' rows at once; a
//      thread that is done takes chunks from the back of another's range (team.h, Shares);
//   3. the activated values into the layout of step 1 (tiny: T*K*I values);
//   4. w2 and the weighted combine, fused: each thread owns a contiguous range of output
//      columns, reads those rows of every active expert's w2 (expert by expert: one long
//      stream each), and adds each pair's weighted contribution. No atomics, no reduction.
// The intermediate (T*K*2I floats) never leaves the caches.
// The four steps run in one OpenMP team with a barrier between them (team.h). The blocks'
// schedule routes inside the team and lets the other threads read ahead meanwhile (warm.h).
//
// That is the schedule of bf16 weights, in rows: [E, N, Kp] uint16 as stored (packed by
// _pack.py at prepare(); the reduction axis padded to 32 with zeros, which the zero-padded
// inputs make exact). int8 and int4 weights run in blocks of 16 rows instead, through the
// same four steps, on inputs quantized to int8 on the fly as llama.cpp does (the integer dot
// product is what keeps up with DRAM on AVX2): forward_blocks.h, blocks_quant.h, _pack.py's
// pack_blocked.


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
#include "forward_blocks.h"
#include "read.h"
#include "stream.h"
#include "team.h"

namespace {

namespace py = pybind11;
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
    TORCH_CHECK(experts > 0 && hidden > 0 && inter > 0, "a layer with experts, H and I");
    for (const OptTensor* b : {&b13_, &b2_})
      TORCH_CHECK(!b->has_value() || ((*b)->scalar_type() == at::kFloat && (*b)->is_contiguous()),
                  "biases: contiguous float32");
    if (fmt != kBf16) {  // int8 / int4: blocks of 16 rows
      TORCH_CHECK(w13_scales.has_value() && w2_scales.has_value(), "blocks: scales");
      const int64_t hp = (hidden + kBlock - 1) / kBlock * kBlock, ip = (inter + kBlock - 1) / kBlock * kBlock;
      blocks_.act = act, blocks_.hidden = hidden, blocks_.inter = inter;
      blocks_.w13 = make_block_proj(fmt, experts, hp, std::move(w13), std::move(*w13_scales), std::move(w13_zeros), w13_bpg, offset);
      blocks_.w2 = make_block_proj(fmt, experts, ip, std::move(w2), std::move(*w2_scales), std::move(w2_zeros), w2_bpg, offset);
      const int64_t ub = (inter + kRows - 1) / kRows;
      TORCH_CHECK(blocks_.w13.blocks == 2 * ub && blocks_.w2.blocks == (hidden + 2 * kRows - 1) / (2 * kRows) * 2,
                  "blocks: w13 holds gate and up blocks per 16 units, w2 pairs of blocks of 16 columns");
      blocks_.b13 = b13_ ? b13_->const_data_ptr<float>() : nullptr;
      blocks_.b2 = b2_ ? b2_->const_data_ptr<float>() : nullptr;
      return;
    }
    TORCH_CHECK(!w13_scales && !w2_scales && !w13_zeros && !w2_zeros, "bf16 weights: no scales or zero points");
    w13_ = make_proj(experts, 2 * inter, std::move(w13));
    w2_ = make_proj(experts, hidden, std::move(w2));
    TORCH_CHECK(w13_.kp >= hidden && w2_.kp >= inter, "padded reduction axes");
  }

  // x [T, H] (float32 or bfloat16, contiguous), tw float32 [T, K], ids int32 [T, K].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids,
                     bool on_input) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "x");
    TORCH_CHECK(tw.scalar_type() == at::kFloat && ids.scalar_type() == at::kInt &&
                tw.is_contiguous() && ids.is_contiguous() && tw.sizes() == ids.sizes() &&
                ids.dim() == 2 && ids.size(0) == x.size(0), "topk_weights / topk_ids");
    if (x.size(0) == 0) return at::empty_like(x);
    if (fmt_ != kBf16) return forward_blocks(blocks_, x, tw, ids, experts_, on_input);
    return forward_rows(route(tw, ids, experts_, on_input), x);
  }

  // benchmarks/bench_stream.py (stream.h): step 2's block loop over w13 of experts
  // [first, first + count), and the bytes it reads, w13's pairs' streams [E, pairs, bytes].
  std::pair<double, double> stream_w13(int64_t first, int64_t count, int64_t inputs) const {
    const BlockProj& w13 = blocks_w13("stream_w13");
    py::gil_scoped_release no_gil;
    return stream_pairs(w13, experts_, first, count, inputs);
  }
  at::Tensor w13_stream() const { return blocks_w13("w13_stream").q; }

 private:
  const BlockProj& blocks_w13(const char* what) const {
    TORCH_CHECK(fmt_ != kBf16, what, ": int8 or int4 weights (blocks); this layer's are bf16 rows");
    return blocks_.w13;
  }

  at::Tensor forward_rows(const Routing& r, const at::Tensor& x) const {
    const int64_t tokens = r.tokens, top_k = r.top_k, pairs = r.pairs;
    const int64_t ip = w2_.kp, blocks = (inter_ + kUnits - 1) / kUnits, cols = (hidden_ + kCols - 1) / kCols;
    at::Tensor out = moe_dispatch::new_output(x);
    Inputs xin, ain;
    xin.init(r.sources(), w13_.kp);
    ain.init(pairs, ip);
    std::vector<float> act(pairs * ip, 0.f);
    const float* b13 = b13_ ? b13_->const_data_ptr<float>() : nullptr;
    const float* b2 = b2_ ? b2_->const_data_ptr<float>() : nullptr;
    Shares items;
    in_team([&](const Team& team) {
      // The vectors are filled by one thread (their remainder vector is allocated lazily).
      auto fill_share = [&](int64_t n) { return std::pair<int64_t, int64_t>{0, team.id == 0 ? n : 0}; };
      team.step([&] {  // 1. inputs: one per token, or one per pair (router weight on the input).
        if (team.id == 0)  // an item reads 2 * kUnits rows
          items.init(team, static_cast<int64_t>(r.active.size()) * blocks, 2 * kUnits * w13_.row_bytes);
        each_input(r, x, hidden_, fill_share(r.sources()),
                   [&](int64_t s, const float* v) { xin.set(s, v, hidden_); });
      });
      team.step([&] {  // 2. w13 and the activation, per (active expert, block of units).
        std::vector<float> gate, up;  // [pairs of the expert, kUnits]
        items.run(team, [&](int64_t item) {
          const int64_t e = r.active[item / blocks], u0 = (item % blocks) * kUnits;
          const int64_t u1 = std::min(inter_, u0 + kUnits), n = r.start[e + 1] - r.start[e];
          gate.resize(n * kUnits);
          up.resize(n * kUnits);
          // The expert's pairs kTile at a time, each tile's inputs reused from L1 by the
          // item's rows (read from memory by the first tile, from L2 by the next ones).
          for (int64_t j = 0; j < n; j += kTile) {
            const int64_t m = std::min(kTile, n - j);
            int64_t idx[kTile];
            for (int64_t q = 0; q < m; ++q) idx[q] = r.source(r.order[r.start[e] + j + q]);
            for (int64_t u = u0; u < u1; ++u) {
              const int64_t rg = gate_row(act_, u), ru = up_row(act_, inter_, u);
              const float bg = b13 ? b13[e * 2 * inter_ + rg] : 0.f, bu = b13 ? b13[e * 2 * inter_ + ru] : 0.f;
              float o[2 * kTile];
              rows_dots(w13_, e, rg, ru, xin, idx, m, o);
              for (int64_t q = 0; q < m; ++q) {
                gate[(j + q) * kUnits + u - u0] = o[2 * q] + bg;
                up[(j + q) * kUnits + u - u0] = o[2 * q + 1] + bu;
              }
            }
          }
          for (int64_t j = 0; j < n; ++j) {
            float* a = act.data() + r.order[r.start[e] + j] * ip;
            activate_units(act_, gate.data() + j * kUnits, up.data() + j * kUnits, a + u0, u1 - u0);
          }
        });
      });
      team.step([&] {  // 3. the activated values in the dot product's layout.
        const auto [p0, p1] = fill_share(pairs);
        for (int64_t p = p0; p < p1; ++p) ain.set(p, act.data() + p * ip, inter_);
      });
      team.step([&] {  // 4. w2 and the weighted combine, per block of output columns.
        // This thread's columns [h0, h1): expert by expert, so that each expert's rows are
        // one contiguous stream (h1 - h0 rows of w2[e]) for the prefetcher.
        const auto [lo, hi] = team.share(cols);
        const int64_t h0 = lo * kCols, h1 = std::min(hidden_, hi * kCols), width = h1 - h0;
        if (width <= 0) return;
        std::vector<float> acc(tokens * width, 0.f);
        for (const int64_t e : r.active) {
          // Two rows at once, h and h + half: two streams per thread, as in step 2 (the
          // middle row of an odd range is computed twice and kept once).
          const int64_t half = (width + 1) / 2;
          // Rows in chunks of kChunk pairs (in L2 after the first tile), and within a chunk
          // the expert's pairs kTile at a time (in L1); each output still sums its pairs in order.
          for (int64_t c0 = h0; c0 < h0 + half; c0 += kChunk) {
            const int64_t c1 = std::min(h0 + half, c0 + kChunk);
            for (int64_t slot = r.start[e]; slot < r.start[e + 1]; slot += kTile) {
              const int64_t m = std::min(kTile, r.start[e + 1] - slot);
              for (int64_t h = c0; h < c1; ++h) {
                const int64_t h2 = h + half < h1 ? h + half : h;
                const float bias0 = b2 ? b2[e * hidden_ + h] : 0.f, bias1 = b2 ? b2[e * hidden_ + h2] : 0.f;
                float o[2 * kTile];
                rows_dots(w2_, e, h, h2, ain, r.order.data() + slot, m, o);
                for (int64_t q = 0; q < m; ++q) {
                  const int64_t p = r.order[slot + q];
                  const float scale = r.on_input ? 1.f : r.w[p];
                  float* a = acc.data() + (p / top_k) * width - h0;
                  a[h] += scale * (o[2 * q] + bias0);
                  if (h2 != h) a[h2] += scale * (o[2 * q + 1] + bias1);
                }
              }
            }
          }
        }
        store_columns(acc, out, h0, h1);
      });
    });
    return out;
  }

  int64_t fmt_, act_, experts_, hidden_, inter_;
  Proj w13_, w2_;  // bf16 weights
  OptTensor b13_, b2_;
  BlockLayer blocks_;  // int8 / int4 weights
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
      out = experts_->forward(*call->x, call->topk_weights, call->topk_ids, on_input_);
    }
    return moe_dispatch::wrap(std::move(out));
  }

 private:
  std::shared_ptr<Experts> experts_;
  bool on_input_;
  moe_dispatch::PlainSpec spec_;
};

// tests/test_native_extension.py: the bf16 rows' input vectors of float32 rows x [n, len] as
// steps 1 and 3 make them (Inputs::set), (f, lo) of [n, kp]: in the avx512 build bf16 bits as
// int16, lo with no rows where every value is a bf16; in the avx2 build the interleaved
// fp32, lo always without rows.
std::pair<at::Tensor, at::Tensor> rows_inputs(const at::Tensor& x, int64_t kp) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rows_inputs: x float32 [n, len], contiguous; got ", x.scalar_type(), " ", x.sizes());
  const int64_t n = x.size(0), len = x.size(1);
  TORCH_CHECK(kp % kBlock == 0 && kp >= len, "rows_inputs: kp a multiple of ", kBlock,
              " and at least len (", len, "), got ", kp);
  Inputs in;
  in.init(n, kp);
  for (int64_t i = 0; i < n; ++i) in.set(i, x.const_data_ptr<float>() + i * len, len);
  auto tensor = [&](const std::vector<BfInput>& v) {
    at::Tensor t = at::empty({v.empty() ? 0 : n, kp}, at::TensorOptions().dtype(MD_AVX512 ? at::kShort : at::kFloat));
    if (!v.empty()) std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(BfInput));
    return t;
  };
  return {tensor(in.f), tensor(in.lo)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-dispatch: the native backend's fused MoE decode kernel";
  m.attr("ISA") = kIsa;
  m.attr("LANES") = kLanes;
  m.def("read_steps", &read_steps, py::arg("t"), py::arg("sizes"),
        "(seconds, xor of the 64-bit words): bytes [0, sum(sizes)) read by the kernel's team, "
        "segment after segment (benchmarks/bench_ceiling.py)");
  m.def("rows_inputs", &rows_inputs, py::arg("x"), py::arg("kp"),
        "(f, lo): the bf16 rows' input vectors of float32 rows x (tests/test_native_extension.py)");
  py::class_<Experts, std::shared_ptr<Experts>>(m, "Experts")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::Tensor, OptTensor, OptTensor,
                    int64_t, at::Tensor, OptTensor, OptTensor, int64_t, int64_t, OptTensor,
                    OptTensor>())
      .def("forward", &Experts::forward, py::call_guard<py::gil_scoped_release>())
      .def("stream_w13", &Experts::stream_w13, py::arg("first"), py::arg("count"), py::arg("inputs") = 1,
           "(seconds, checksum): step 2's block loop alone over w13 of experts [first, first + count) "
           "(benchmarks/bench_stream.py)")
      .def("w13_stream", &Experts::w13_stream, "w13's pairs' streams, uint8 [E, pairs, bytes]");
  py::class_<FastCall>(m, "FastCall")
      .def(py::init<std::shared_ptr<Experts>, bool, int64_t, int64_t, int64_t, at::ScalarType,
                    std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("entry", [](const FastCall& f) { return moe_dispatch::entry_function(f); },
           "The entry as a CPython function (the layer calls it on every plain call).");
}
