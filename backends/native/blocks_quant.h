// int8 / int4 weights in the avx512 build, and int4 weights in the avx2 build: blocks of 16
// rows (_pack.py's pack_blocked), so that one 64-byte load holds 4 values of each of 16 rows
// and one vpdpbusd multiplies them by 4 values of one input broadcast to every lane: each
// int32 lane is one row's dot product, and a block's 16 sums come out as one vector. The avx2
// build reads the same bytes as two halves of 8 rows (int4_block_dots_avx2, at the end).
//
// Why this layout and not a row's values side by side (dots_quant.h, the avx2 build): with
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
// result is the exact integer dot product of the signed weights and the inputs.

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
  // Fill vector i from len fp32 values (the rest of kp stays zero): quantize_range's values
  // (amax / 127, round to nearest even), 16 at a time (scalar, this was a quarter of C1's
  // time at T=512).
  void set(int64_t i, const float* v, int64_t len) {
    int8_t* out = q.data() + i * kp;
    int32_t* su = sum.data() + i * units;
#if MD_AVX512
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t lo = g * group, hi = std::min(len, lo + group);
      if (hi <= lo) break;
      __m512 m = _mm512_setzero_ps();
      __mmask16 bad = 0;  // lanes that held a NaN or an infinity (vmaxps drops a NaN)
      for (int64_t k = lo; k < hi; k += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(k, hi), v + k));
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
        m = _mm512_max_ps(m, a);
      }
      if (bad) {  // the group's values stay 0 and its scale is NaN: its dot products are NaN
        s[i * groups + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float amax = _mm512_reduce_max_ps(m);
      // Below 127 / FLT_MAX, 127 / amax is infinite: the group is taken as zeros (quantize_range).
      const __m512 inv = _mm512_set1_ps(amax >= 127.f / std::numeric_limits<float>::max() ? 127.f / amax : 0.f);
      s[i * groups + g] = amax / 127.f;
      for (int64_t u0 = lo; u0 < hi; u0 += unit) {  // units nest in groups (unit_for)
        __m512i acc = _mm512_setzero_si512();
        for (int64_t k = u0; k < std::min(hi, u0 + unit); k += 16) {
          const __mmask16 mk = tail(k, hi);
          const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, v + k), inv));
          _mm512_mask_cvtepi32_storeu_epi8(out + k, mk, r);
          acc = _mm512_add_epi32(acc, r);
        }
        su[u0 / unit] = _mm512_reduce_add_epi32(acc);
      }
    }
#else
    // The same values as the avx512 build's: amax / 127, products rounded to nearest even
    // (cvtps_epi32 in the default rounding mode, nearbyint in the tails).
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t lo = g * group, hi = std::min(len, lo + group);
      if (hi <= lo) break;
      __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      float amax = 0.f;
      bool finite = true;
      int64_t k = lo;
      for (; k + 8 <= hi; k += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
        m = _mm256_max_ps(m, a);
      }
      for (; k < hi; ++k) {
        const float a = std::fabs(v[k]);
        if (!(a <= std::numeric_limits<float>::max())) finite = false;
        else amax = std::max(amax, a);
      }
      if (_mm256_movemask_ps(bad) || !finite) {  // values stay 0, the scale NaN (as above)
        s[i * groups + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      for (const float l : lanes) amax = std::max(amax, l);
      // As quantize_range: a group below 127 / FLT_MAX is taken as zeros (127 / amax would
      // be infinite, and converted, INT_MIN, which packs saturate to -128).
      const float inv = amax >= 127.f / std::numeric_limits<float>::max() ? 127.f / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      s[i * groups + g] = amax / 127.f;
      for (int64_t u0 = lo; u0 < hi; u0 += unit) {
        const int64_t u1 = std::min(hi, u0 + unit);
        __m256i acc = _mm256_setzero_si256();
        int32_t tail_sum = 0;
        k = u0;
        for (; k + 8 <= u1; k += 8) {
          const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + k), vinv));
          const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(w, w));
          acc = _mm256_add_epi32(acc, r);
        }
        for (; k < u1; ++k) {
          const int32_t r = static_cast<int32_t>(std::nearbyint(v[k] * inv));
          out[k] = static_cast<int8_t>(r);
          tail_sum += r;
        }
        alignas(32) int32_t parts[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(parts), acc);
        for (const int32_t p : parts) tail_sum += p;
        su[u0 / unit] = tail_sum;
      }
    }
#endif
  }

#if MD_AVX512
 private:
  static __mmask16 tail(int64_t k, int64_t hi) {
    return hi - k >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (hi - k)) - 1);
  }
#endif
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

#if MD_AVX512
inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(four(p)); }

// The pair of blocks b0, b0 + 1 (b0 even, read as _pack.py interleaves them) of expert e
// dotted with the N inputs idx[], into o[(r * N + n) * 16 + lane] (fp32, scaled). Inlined
// loops with constant trip counts keep the 2 x N sums in registers.
template <int N, bool kInt4>
void block_dots(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                const int64_t* idx, float* o) {
  constexpr int R = 2;  // blocks per call: a pair
  const int8_t* x[N];
  const uint8_t* w[R];
#pragma GCC unroll 6
  for (int n = 0; n < N; ++n) x[n] = in.q.data() + idx[n] * in.kp;
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) w[r] = p.block(e, b0) + r * 64;  // the pair's blocks interleave
  __m512 f[R][N];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) f[r][n] = _mm512_setzero_ps();
  const bool per_row = p.group >= p.kp;
  for (int64_t u = 0; u < in.units; ++u) {
    const int64_t k0 = u * in.unit, k1 = std::min(p.kp, k0 + in.unit), g = k0 / p.group;
    __m512i a[R][N], z[R];  // z: the rows' zero points of this unit, loaded once for all inputs
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) z[r] = p.z ? p.zero(e, b0 + r, g) : _mm512_setzero_si512();
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) {
      const int32_t xsum = in.sum[idx[n] * in.units + u];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
        a[r][n] = p.z ? _mm512_mullo_epi32(z[r], _mm512_set1_epi32(-xsum))
                      : _mm512_set1_epi32(static_cast<int32_t>(-p.off * xsum));
    }
    if constexpr (kInt4) {
#pragma GCC unroll 2
      for (int64_t k = k0; k < k1; k += 8) {  // two steps per 64 bytes: low nibbles, high
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_loadu_si512(w[r] + k * 16);
          const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
#pragma GCC unroll 6
          for (int n = 0; n < N; ++n) {
            a[r][n] = _mm512_dpbusd_epi32(a[r][n], lo, bcast4(x[n] + k));
            a[r][n] = _mm512_dpbusd_epi32(a[r][n], hi, bcast4(x[n] + k + 4));
          }
        }
      }
    } else {
#pragma GCC unroll 4
      for (int64_t k = k0; k < k1; k += 4) {
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_loadu_si512(w[r] + k * 32);
#pragma GCC unroll 6
          for (int n = 0; n < N; ++n) a[r][n] = _mm512_dpbusd_epi32(a[r][n], v, bcast4(x[n] + k));
        }
      }
    }
    // Scaled once per unit: by the input's scale, and with weight groups by the rows'
    // scales too (a per-row scale is applied once, after the units).
    const int64_t ag = k0 / in.group;
    __m512 ws[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) ws[r] = per_row ? _mm512_setzero_ps() : p.scale(e, b0 + r, g);
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) {
      const __m512 xs = _mm512_set1_ps(in.s[idx[n] * in.groups + ag]);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
        f[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][n]), per_row ? xs : _mm512_mul_ps(ws[r], xs), f[r][n]);
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    const __m512 rs = per_row ? p.scale(e, b0 + r, 0) : _mm512_set1_ps(1.f);
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(o + (r * N + n) * kRows, _mm512_mul_ps(f[r][n], rs));
  }
}

template <bool kInt4>
inline void block_dots_n(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                         const int64_t* idx, int64_t n, float* o) {
  switch (n) {
    case 1: return block_dots<1, kInt4>(p, e, b0, in, idx, o);
    case 2: return block_dots<2, kInt4>(p, e, b0, in, idx, o);
    case 3: return block_dots<3, kInt4>(p, e, b0, in, idx, o);
    case 4: return block_dots<4, kInt4>(p, e, b0, in, idx, o);
    case 5: return block_dots<5, kInt4>(p, e, b0, in, idx, o);
    default: return block_dots<6, kInt4>(p, e, b0, in, idx, o);
  }
}

// The pair of blocks b0, b0 + 1 (b0 even) with n (1..kTile) inputs: o[(r * n + q) * 16 + lane].
inline void pair_dots(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                      const int64_t* idx, int64_t n, float* o) {
  if (p.int4) block_dots_n<true>(p, e, b0, in, idx, n, o);
  else block_dots_n<false>(p, e, b0, in, idx, n, o);
}

#else  // the avx2 build: int4 blocks only (int8 keeps its rows, dots_quant.h)

// Inputs q0 .. q0 + N - 1 of the n dotted with the pair of int4 blocks b0, b0 + 1, into
// o[(r * n + q) * 16 + lane]. A block's 64 bytes per step of 8 values are two halves of 8
// rows (one int32 lane per row, as in the avx512 build): maddubs multiplies the nibbles
// (unsigned, <= 15) by the input's signed values in pairs into int16 (<= 3810 in magnitude
// per pair sum, 7620 with the low and high nibbles added), up to four steps are summed in
// int16 (<= 30480)
// before madd widens them to int32, and each unit's sums are scaled for 8 rows at once.
// Why blocks and not the rows of dots_quant.h: per row pair, the rows' int4 loop scales every
// pair of blocks per row and ends with horizontal sums and a zero-point tail, which made
// int4 bound by its arithmetic on AVX2 (docs/backends/native.md, Zen 3).
template <int N>
void int4_block_dots_avx2(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                          const int64_t* idx, int64_t n, int64_t q0, float* o) {
  constexpr int kHalves = 4;  // (block r, half h) = (i / 2, i % 2)
  const int8_t* x[N];
  for (int j = 0; j < N; ++j) x[j] = in.q.data() + idx[j] * in.kp;
  const uint8_t* w = p.block(e, b0);  // step k (8 values): block b0's 64 bytes, then b0 + 1's
  const __m256i m = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const bool per_row = p.group >= p.kp;
  __m256 f[kHalves][N];
  for (int i = 0; i < kHalves; ++i)
    for (int j = 0; j < N; ++j) f[i][j] = _mm256_setzero_ps();
  for (int64_t u = 0; u < in.units; ++u) {
    const int64_t k0 = u * in.unit, k1 = std::min(p.kp, k0 + in.unit), g = k0 / p.group;
    __m256i a[kHalves][N];
    for (int j = 0; j < N; ++j) {
      const int32_t xsum = in.sum[idx[j] * in.units + u];
      for (int i = 0; i < kHalves; ++i)
        a[i][j] = p.z ? _mm256_mullo_epi32(p.zero8(e, b0 + i / 2, g, i % 2), _mm256_set1_epi32(-xsum))
                      : _mm256_set1_epi32(static_cast<int32_t>(-p.off * xsum));
    }
    for (int64_t k = k0; k < k1;) {
      const int64_t k4 = std::min(k1, k + 32);
      __m256i s16[kHalves][N];
      for (int i = 0; i < kHalves; ++i)
        for (int j = 0; j < N; ++j) s16[i][j] = _mm256_setzero_si256();
      for (; k < k4; k += 8) {
        __m256i xa[N], xb[N];
        for (int j = 0; j < N; ++j) xa[j] = _mm256_set1_epi32(four(x[j] + k)), xb[j] = _mm256_set1_epi32(four(x[j] + k + 4));
#pragma GCC unroll 4
        for (int i = 0; i < kHalves; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 16 + i * 32));
          const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
          for (int j = 0; j < N; ++j)
            s16[i][j] = _mm256_add_epi16(s16[i][j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[j]),
                                                                     _mm256_maddubs_epi16(hi, xb[j])));
        }
      }
      for (int i = 0; i < kHalves; ++i)
        for (int j = 0; j < N; ++j) a[i][j] = _mm256_add_epi32(a[i][j], _mm256_madd_epi16(s16[i][j], ones));
    }
    const int64_t ag = k0 / in.group;
    for (int j = 0; j < N; ++j) {
      const __m256 xs = _mm256_set1_ps(in.s[idx[j] * in.groups + ag]);
      for (int i = 0; i < kHalves; ++i)
        f[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i][j]),
                                  per_row ? xs : _mm256_mul_ps(p.scale8(e, b0 + i / 2, g, i % 2), xs), f[i][j]);
    }
  }
  for (int i = 0; i < kHalves; ++i) {
    const __m256 rs = per_row ? p.scale8(e, b0 + i / 2, 0, i % 2) : _mm256_set1_ps(1.f);
    for (int j = 0; j < N; ++j)
      _mm256_storeu_ps(o + ((i / 2) * n + q0 + j) * kRows + (i % 2) * 8, _mm256_mul_ps(f[i][j], rs));
  }
}

inline void pair_dots(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                      const int64_t* idx, int64_t n, float* o) {
  for (int64_t q = 0; q < n; q += 2) {
    if (q + 1 < n) int4_block_dots_avx2<2>(p, e, b0, in, idx + q, n, q, o);
    else int4_block_dots_avx2<1>(p, e, b0, in, idx + q, n, q, o);
  }
}

#endif  // MD_AVX512

}  // namespace moe_dispatch_native
