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

// One projection in blocks: q [E, blocks, Kp * 16] (int4: Kp * 8) bytes, scales fp32 or fp16
// and zero points uint8 [E, blocks, groups, 16].
struct BlockProj {
  at::Tensor q, scales, zeros;
  const uint8_t* base = nullptr;
  const float* s32 = nullptr;
  const uint16_t* s16 = nullptr;
  const uint8_t* z = nullptr;
  int64_t blocks = 0, kp = 0, groups = 1, group = 0, off = 0, block_bytes = 0;
  bool int4 = false;
  const uint8_t* block(int64_t e, int64_t b) const { return base + (e * blocks + b) * block_bytes; }
  int64_t at(int64_t e, int64_t b, int64_t g) const { return ((e * blocks + b) * groups + g) * kRows; }
#if MD_AVX512
  __m512 scale(int64_t e, int64_t b, int64_t g) const {
    const int64_t i = at(e, b, g);
    return s16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16 + i)))
               : _mm512_loadu_ps(s32 + i);
  }
  __m512i zero(int64_t e, int64_t b, int64_t g) const {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + at(e, b, g))));
  }
#else
  // Rows 8h .. 8h + 7 of the block (h = 0, 1): the avx2 build reads a block as two halves.
  __m256 scale8(int64_t e, int64_t b, int64_t g, int64_t h) const {
    const int64_t i = at(e, b, g) + 8 * h;
    return s16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + i)))
               : _mm256_loadu_ps(s32 + i);
  }
  __m256i zero8(int64_t e, int64_t b, int64_t g, int64_t h) const {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + at(e, b, g) + 8 * h)));
  }
#endif
};

inline BlockProj make_block_proj(int64_t fmt, int64_t experts, int64_t kp, at::Tensor q,
                                 at::Tensor scales, std::optional<at::Tensor> zeros,
                                 int64_t bpg, int64_t offset) {
  BlockProj p;
  p.int4 = fmt == kInt4;
  TORCH_CHECK(fmt == kInt8 || fmt == kInt4, "blocks: int8 or int4 weights");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte && q.size(0) == experts,
              "blocked weights [E, blocks, bytes] uint8");
  TORCH_CHECK(kp % kBlock == 0 && q.size(2) == kp * kRows / (p.int4 ? 2 : 1), "blocked weights' width");
  TORCH_CHECK(q.size(1) % 2 == 0, "blocks in pairs");
  p.blocks = q.size(1), p.kp = kp, p.block_bytes = q.size(2), p.group = bpg * kBlock;
  p.groups = (kp + p.group - 1) / p.group;
  TORCH_CHECK(p.group >= kBlock && (p.group >= kp || (p.group & (p.group - 1)) == 0),
              "weight groups: per row, or a power of two of at least 32 values");
  TORCH_CHECK(scales.dim() == 4 && scales.is_contiguous() && scales.size(0) == experts &&
              scales.size(1) == p.blocks && scales.size(2) == p.groups && scales.size(3) == kRows,
              "blocked scales [E, blocks, groups, 16]");
  if (scales.scalar_type() == at::kHalf)
    p.s16 = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  else if (scales.scalar_type() == at::kFloat)
    p.s32 = scales.const_data_ptr<float>();
  else
    TORCH_CHECK(false, "scales fp16 or fp32");
  if (zeros.has_value()) {
    TORCH_CHECK(p.int4 && zeros->scalar_type() == at::kByte && zeros->sizes() == scales.sizes() &&
                zeros->is_contiguous(), "zeros uint8 like scales (int4)");
    p.zeros = *zeros;
    p.z = p.zeros.const_data_ptr<uint8_t>();
  }
  p.off = p.int4 ? offset : 128;
  p.scales = std::move(scales);
  p.q = std::move(q);
  p.base = p.q.const_data_ptr<uint8_t>();
  return p;
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
