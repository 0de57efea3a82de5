// int8 / int4 weights, in both builds: blocks of 16 rows (_pack.py's pack_blocked), so that
// one 64-byte load holds 4 values of each of 16 rows and one vpdpbusd multiplies them by 4 values of one input broadcast to every lane: each
// int32 lane is one row's dot product, and a block's 16 sums come out as one vector. The avx2
// build reads the same bytes as two halves of 8 rows. This header holds what both builds
// share; blocks_avx512.h and blocks_avx2.h the quantizer of the inputs and the dot products.
//
// Why this layout and not a row's values side by side (as bf16 weights run, dots_bf16.h): with
// rows side by side each lane holds part of one (row, input) dot product, so every sum that
// must be scaled in fp32 (per block of inputs' values, and per weight group) costs a convert
// and an FMA per vpdpbusd or two, on the pipes vpdpbusd needs (measured on one Zen 4 core:
// vpdpbusd alone ~210 GMAC/s, halved by scaling per 64 values), and the sums end in a
// horizontal add. Here a unit of 128 values is 32 vpdpbusd per (block, input), one convert,
// multiply and FMA scale 16 rows' sums, and nothing is reduced across lanes. On a Zen 4 at
// C2 T=512 (bench_quant.py, two runs whose bf16 default took 96 and 95 ms) the forced native
// layer went from 94 ms (rows, in tiles of two rows by six inputs) to 64 for int8, and from
// 110 to 67 for int4 g128.
//
// vpdpbusd multiplies unsigned by signed bytes: the weights are the unsigned operand (int8
// stored + 128, int4 as u in 0..15) and the inputs signed int8, quantized per group of
// values with one fp32 scale (amax / 127). So each unit's int32 sum carries
// off x sum(inputs) (off: 128, or int4's constant offset) or zero x sum(inputs) with zero
// points: the inputs' sums per unit (BlockInputs.sum) start each sum, negated, and the
// result is the exact integer dot product of the signed weights and the inputs. (The avx2
// build's int8 makes the weights signed instead and needs no offset: blocks_avx2.h.)

#pragma once

#include "layout.h"

namespace moe_dispatch_native {

constexpr int64_t kRows = 16;       // rows per block (one int32 lane each)
constexpr int64_t kWideGroup = 128; // values per scale of x above 16 tokens (forward_blocks.h)
constexpr int64_t kNarrowGroup = 32;// of x up to 16 tokens, and of the intermediate at every T

// One projection in blocks: q [E, pairs, groups * (scales + steps)] bytes, the pairs'
// streams of _pack.py: per weight group, the pair's scales (block 2p's 16, then 2p + 1's;
// fp16 or fp32), then the group's steps (int4: 16 bytes of the pair per K value, int8: 32).
// Why the scales in the stream: in an array of their own ([E, blocks, groups, 16]) they
// were a second stream per pair beside the weights, read per unit of 32 values, and at
// decode they were what the int4 loop lost most of its time to (measured on a Zen 5:
// reading no scales at all took int4 g32 to 0.77-0.84x of its time, where its arithmetic
// removed took it to 0.96-1.00x). In the stream, with the prefetch following the stream
// (prefetch_unit), against the separate array, two builds paired in one process (cold, C1
// and C2, T=1-8): avx512 build int4 g32 0.86-0.94x of the time, g128 0.95-0.98x, int8 per
// channel 0.96-0.97x; avx2 build (on the same Zen 5) g32 0.87-0.96x, g128 0.95-1.00x, int8
// 0.91-0.98x. Zero points stay uint8 [E, blocks, groups, 16].
struct BlockProj {
  at::Tensor q, zeros;
  const uint8_t* base = nullptr;
  const uint8_t* z = nullptr;
  int64_t blocks = 0, kp = 0, groups = 1, group = 0, off = 0;
  int64_t block_bytes = 0;  // a block's steps (Kp values of 16 rows), scales not counted
  int64_t esize = 4;      // bytes per scale: 2 (fp16) or 4 (fp32)
  int64_t head = 0;       // bytes of a group's scales in a pair's stream: 2 x 16 scales
  int64_t values = 0;     // K values per group: the group, or Kp with per-row scales
  int64_t per_value = 0;  // bytes of a pair per K value: 16 (int4) or 32 (int8)
  int64_t stride = 0;     // bytes per group in a pair's stream: head + values * per_value
  int64_t pair_bytes = 0;
  bool int4 = false;
  const uint8_t* pair(int64_t e, int64_t b) const { return base + (e * (blocks / 2) + b / 2) * pair_bytes; }
  // The pair's steps from value k0 on, k0 in weight group g (a unit never straddles one).
  const uint8_t* weights(int64_t e, int64_t b0, int64_t g, int64_t k0) const {
    return pair(e, b0) + g * stride + head + (k0 - g * values) * per_value;
  }
  const uint8_t* scales_of(int64_t e, int64_t b, int64_t g) const {
    return pair(e, b) + g * stride + (b & 1) * kRows * esize;
  }
  int64_t at(int64_t e, int64_t b, int64_t g) const { return ((e * blocks + b) * groups + g) * kRows; }  // zeros
#if MD_AVX512
  __m512 scale(int64_t e, int64_t b, int64_t g) const {
    const uint8_t* s = scales_of(e, b, g);
    return esize == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)))
                      : _mm512_loadu_ps(reinterpret_cast<const float*>(s));
  }
  __m512i zero(int64_t e, int64_t b, int64_t g) const {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + at(e, b, g))));
  }
#else
  // Rows 8h .. 8h + 7 of the block (h = 0, 1): the avx2 build reads a block as two halves.
  __m256 scale8(int64_t e, int64_t b, int64_t g, int64_t h) const {
    const uint8_t* s = scales_of(e, b, g) + 8 * h * esize;
    return esize == 2 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)))
                      : _mm256_loadu_ps(reinterpret_cast<const float*>(s));
  }
  __m256i zero8(int64_t e, int64_t b, int64_t g, int64_t h) const {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + at(e, b, g) + 8 * h)));
  }
#endif
};

// q: the pairs' streams; scales: the same scales as [E, blocks, groups, 16] (their shape and
// dtype checked here against the stream's; the kernel reads them from the stream only).
inline BlockProj make_block_proj(int64_t fmt, int64_t experts, int64_t kp, at::Tensor q,
                                 const at::Tensor& scales, std::optional<at::Tensor> zeros,
                                 int64_t bpg, int64_t offset) {
  BlockProj p;
  p.int4 = fmt == kInt4;
  TORCH_CHECK(fmt == kInt8 || fmt == kInt4, "blocks: int8 or int4 weights");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte && q.size(0) == experts,
              "blocked weights [E, pairs, bytes] uint8");
  TORCH_CHECK(kp % kBlock == 0, "blocked weights' width");
  p.blocks = 2 * q.size(1), p.kp = kp, p.block_bytes = kp * kRows / (p.int4 ? 2 : 1), p.group = bpg * kBlock;
  p.groups = (kp + p.group - 1) / p.group;
  TORCH_CHECK(p.group >= kBlock && (p.group >= kp || ((p.group & (p.group - 1)) == 0 && kp % p.group == 0)),
              "weight groups: per row, or a power of two of at least 32 values that divides Kp");
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == experts && scales.size(1) == p.blocks &&
              scales.size(2) == p.groups && scales.size(3) == kRows, "blocked scales [E, blocks, groups, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat, "scales fp16 or fp32");
  if (zeros.has_value()) {
    TORCH_CHECK(p.int4 && zeros->scalar_type() == at::kByte && zeros->sizes() == scales.sizes() &&
                zeros->is_contiguous(), "zeros uint8 like scales (int4)");
    p.zeros = *zeros;
    p.z = p.zeros.const_data_ptr<uint8_t>();
  }
  p.off = p.int4 ? offset : 128;
  p.esize = scales.element_size();
  p.head = 2 * kRows * p.esize;
  p.values = std::min(p.group, kp);
  p.per_value = p.int4 ? 16 : 32;
  p.stride = p.head + p.values * p.per_value;
  p.pair_bytes = p.groups * p.stride;
  TORCH_CHECK(q.size(2) == p.pair_bytes, "blocked weights: per pair, groups x (scales + steps) = ",
              p.pair_bytes, " bytes, got ", q.size(2));
  p.q = std::move(q);
  p.base = p.q.const_data_ptr<uint8_t>();
  return p;
}

// Software prefetch of a unit's part of its pair's stream, `ahead` bytes on: from the unit's
// steps w (values k0 .. k1 of weight group g), back to the group's scales when the unit is
// the group's first, to the unit's end; called once per unit. Why whole units and from the
// stream's bytes, not 512 bytes of steps at a time: the steps of consecutive units are not
// contiguous (a group's scales sit between them), and prefetching only the steps' bytes
// left the first line of every unit unasked for (measured: that form was 1.02-1.11x of the
// time of the scales in an array of their own; this one, see BlockProj).
inline void prefetch_unit(const BlockProj& p, const uint8_t* w, int64_t g, int64_t k0, int64_t k1,
                          int64_t ahead) {
  const uint8_t* from = w - (g * p.values == k0 ? p.head : 0) + ahead;
  const uint8_t* to = w + (k1 - k0) * p.per_value + ahead;
  for (const uint8_t* l = from; l < to; l += 64) _mm_prefetch(reinterpret_cast<const char*>(l), _MM_HINT_T0);
}

// Inputs of the blocks: int8 values (natural order), per group of `group` values one fp32
// scale, per unit of `unit` values the sum of the values (the offset's term). The unit
// divides the group or is the whole row (unit_for).
struct BlockInputs {
  int64_t n = 0, kp = 0, group = 0, unit = 0, groups = 0, units = 0;
  std::vector<int8_t> q;   // [n, kp]
  std::vector<float> s;    // [n, groups]
  std::vector<int32_t> sum;  // [n, units]
  void init(int64_t n_, int64_t kp_, int64_t group_, int64_t unit_) {
    n = n_, kp = kp_, group = group_, unit = unit_;
    groups = (kp + group - 1) / group, units = (kp + unit - 1) / unit;
    q.assign(n * kp, 0);
    s.assign(n * groups, 0.f);
    sum.assign(n * units, 0);
  }
  // Fill vector i from len fp32 values (the rest of kp stays zero): per group a symmetric
  // scale (amax / 127, round to nearest even), vectorised per ISA (blocks_avx512.h, blocks_avx2.h:
  // scalar, this was a quarter of C1's time at T=512).
  void set(int64_t i, const float* v, int64_t len);
};

// The unit of a projection's sums for inputs quantized per `group` values: no unit straddles
// an input group or a weight group (both powers of two, or the weight group is the row).
inline int64_t unit_for(const BlockProj& p, int64_t group) {
  return std::min({group, p.group, p.kp});
}

inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace moe_dispatch_native

#if MD_AVX512
#include "blocks_avx512.h"
#else
#include "blocks_avx2.h"
#endif
