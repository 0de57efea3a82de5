// The avx2 build's blocks (blocks_quant.h; int8 and int4): BlockInputs::set and the pair
// dot products, a maddubs per 8 rows.

#pragma once

#include "blocks_quant.h"

namespace moe_dispatch_native {

inline void BlockInputs::set(int64_t i, const float* v, int64_t len) {
  int8_t* out = q.data() + i * kp;
  int32_t* su = sum.data() + i * units;
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
    if (_mm256_movemask_ps(bad) || !finite) {  // values stay 0, the scale NaN (as avx512's)
      s[i * groups + g] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (const float l : lanes) amax = std::max(amax, l);
    // A group below 127 / FLT_MAX is taken as zeros (127 / amax would be infinite, and
    // converted, INT_MIN, which packs saturate to -128), as in the avx512 build.
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
}

// The pair dot products below (int4, int8) end the same way. scale_unit: f[i][j] += one unit's
// int32 sums a[i][j] x input j's scale of the unit (its group ag) x the rows' scales of weight
// group g (1 with a scale per row, which store_pair applies once).
template <int N>
__attribute__((always_inline)) inline void scale_unit(const BlockProj& p, int64_t e, int64_t b0, int64_t g,
                                                      const float* const* xs, int64_t ag,
                                                      const __m256i (&a)[4][N], __m256 (&f)[4][N]) {
  const bool per_row = p.group >= p.kp;
  for (int i = 0; i < 4; ++i) {  // (block r, half h) = (i / 2, i % 2)
    const __m256 ws = per_row ? _mm256_set1_ps(1.f) : p.scale8(e, b0 + i / 2, g, i % 2);
    for (int j = 0; j < N; ++j)
      f[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i][j]), _mm256_mul_ps(ws, _mm256_set1_ps(xs[j][ag])), f[i][j]);
  }
}

// o[(r * n + q0 + j) * 16 + lane] = f x the rows' scale where it is one per row.
template <int N>
__attribute__((always_inline)) inline void store_pair(const BlockProj& p, int64_t e, int64_t b0,
                                                      const __m256 (&f)[4][N], int64_t n, int64_t q0, float* o) {
  const bool per_row = p.group >= p.kp;
  for (int i = 0; i < 4; ++i) {
    const __m256 rs = per_row ? p.scale8(e, b0 + i / 2, 0, i % 2) : _mm256_set1_ps(1.f);
    for (int j = 0; j < N; ++j)
      _mm256_storeu_ps(o + ((i / 2) * n + q0 + j) * kRows + (i % 2) * 8, _mm256_mul_ps(f[i][j], rs));
  }
}

// Inputs q0 .. q0 + N - 1 of the n dotted with the pair of int4 blocks b0, b0 + 1, into
// o[(r * n + q) * 16 + lane]. A block's 64 bytes per step of 8 values are two halves of 8
// rows (one int32 lane per row, as in the avx512 build): maddubs multiplies the nibbles
// (unsigned, <= 15) by the input's signed values in pairs into int16 (<= 3810 in magnitude
// per pair sum, 7620 with the low and high nibbles added), a chunk of four steps (32 values)
// is summed in int16 (<= 30480) before madd widens it to int32, and each unit's sums are
// scaled for 8 rows at once. Why blocks and not a row's values side by side: an int4 loop
// over rows scaled every pair of blocks of every row and ended each row with horizontal sums
// and a zero-point tail, which bound it by its arithmetic on AVX2 (architecture.md:
// 0.65-0.92x of its time at decode in blocks, on a Zen 3).
//
// Units (32 values at decode) are short, so what runs once per unit counts: the chunks have
// a constant trip count of four steps (a loop, not unrolled: see below), the unit's groups
// are counted with shifts (both are powers of two when they are not the whole row), and the
// zero points are a template argument (measured on a Zen 3 with the weights in L3, C2 T=1:
// the per-unit work was 44% of this function's time when each unit divided twice and tested
// for zero points).
template <int N, bool kZeros>
void int4_block_dots_avx2(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                          const int64_t* idx, int64_t n, int64_t q0, float* o) {
  constexpr int kHalves = 4;  // (block r, half h) = (i / 2, i % 2)
  const int8_t* x[N];
  const int32_t* xsum[N];
  const float* xs[N];
  for (int j = 0; j < N; ++j) {
    x[j] = in.q.data() + idx[j] * in.kp;
    xsum[j] = in.sum.data() + idx[j] * in.units;
    xs[j] = in.s.data() + idx[j] * in.groups;
  }
  const __m256i m = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const bool per_row = p.group >= p.kp;
  const int wshift = per_row ? 0 : __builtin_ctzll(static_cast<uint64_t>(p.group));
  const int xshift = __builtin_ctzll(static_cast<uint64_t>(in.group));  // 32 or 128
  __m256 f[kHalves][N];
  for (int i = 0; i < kHalves; ++i)
    for (int j = 0; j < N; ++j) f[i][j] = _mm256_setzero_ps();
  for (int64_t u = 0; u < in.units; ++u) {
    const int64_t k0 = u * in.unit, k1 = std::min(p.kp, k0 + in.unit);
    const int64_t g = per_row ? 0 : k0 >> wshift;
    // The unit's steps in the pair's stream: step k (8 values) at (k - k0) * 16, block b0's
    // 64 bytes, then b0 + 1's; the unit's stream kAhead ahead (layout.h), past the pair's end
    // into the next pair, which a thread's share reads next. Why: the blocks cost more
    // arithmetic per byte than bf16, and without it a cold call computed and waited for
    // memory in turn (Zen 3, 2 threads, in its earlier form of 512 bytes at a time and the
    // scales in an array of their own: 0.85-0.95x of the time without it at C1 and C2 T=1-16).
    const uint8_t* w = p.weights(e, b0, g, k0);
    prefetch_unit(p, w, g, k0, k1, kAhead);
    __m256i a[kHalves][N];
    for (int j = 0; j < N; ++j) {
      if constexpr (kZeros) {
        for (int i = 0; i < kHalves; ++i)
          a[i][j] = _mm256_mullo_epi32(p.zero8(e, b0 + i / 2, g, i % 2), _mm256_set1_epi32(-xsum[j][u]));
      } else {
        const __m256i off = _mm256_set1_epi32(static_cast<int32_t>(-p.off * xsum[j][u]));
        for (int i = 0; i < kHalves; ++i) a[i][j] = off;
      }
    }
    for (int64_t k = k0; k < k1; k += 32) {  // chunks of 4 steps (kp is a multiple of 32)
      __m256i s16[kHalves][N];
      for (int i = 0; i < kHalves; ++i)
        for (int j = 0; j < N; ++j) s16[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int64_t t = 0; t < 4; ++t) {  // not unrolled: GCC then hoists the 32 maddubs and spills them
        const int64_t kk = k + 8 * t, pos = (kk - k0) * 16;
        __m256i xa[N], xb[N];
        for (int j = 0; j < N; ++j) xa[j] = _mm256_set1_epi32(four(x[j] + kk)), xb[j] = _mm256_set1_epi32(four(x[j] + kk + 4));
#pragma GCC unroll 4
        for (int i = 0; i < kHalves; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + pos + i * 32));
          const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
          for (int j = 0; j < N; ++j)
            s16[i][j] = _mm256_add_epi16(s16[i][j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[j]),
                                                                     _mm256_maddubs_epi16(hi, xb[j])));
        }
      }
      for (int i = 0; i < kHalves; ++i)
        for (int j = 0; j < N; ++j) a[i][j] = _mm256_add_epi32(a[i][j], _mm256_madd_epi16(s16[i][j], ones));
    }
    scale_unit<N>(p, e, b0, g, xs, k0 >> xshift, a, f);
  }
  store_pair<N>(p, e, b0, f, n, q0, o);
}

// int8: the same pairs of blocks, a step of 4 values per 64 bytes (16 rows x 4, stored
// q + 128 as for vpdpbusd). maddubs takes an unsigned and a signed operand and q + 128 times
// an input overflows its int16 pair sums (2 x 255 x 127), so each 32 bytes are made signed
// (xor 0x80) and the sign moved to the input: |q| times x with q's sign (<= 2 x 128 x 127 =
// 32512 per pair sum), exact, and widened to int32 at every step. No offset term: the dot
// products are the signed ones. Why blocks and not rows (where int8 ran before, a row's 32
// values side by side): a convert and an FMA per block of every row and a horizontal sum
// per row; one thread in L2 streamed 47 GB/s of weights in blocks against 32 in rows
// (standalone loops, Zen 3).
template <int N>
void int8_block_dots_avx2(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                          const int64_t* idx, int64_t n, int64_t q0, float* o) {
  constexpr int kHalves = 4;  // (block r, half h) = (i / 2, i % 2)
  const int8_t* x[N];
  const float* xs[N];
  for (int j = 0; j < N; ++j) x[j] = in.q.data() + idx[j] * in.kp, xs[j] = in.s.data() + idx[j] * in.groups;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const bool per_row = p.group >= p.kp;
  const int wshift = per_row ? 0 : __builtin_ctzll(static_cast<uint64_t>(p.group));
  const int xshift = __builtin_ctzll(static_cast<uint64_t>(in.group));
  __m256 f[kHalves][N];
  for (int i = 0; i < kHalves; ++i)
    for (int j = 0; j < N; ++j) f[i][j] = _mm256_setzero_ps();
  for (int64_t u = 0; u < in.units; ++u) {
    const int64_t k0 = u * in.unit, k1 = std::min(p.kp, k0 + in.unit), g = per_row ? 0 : k0 >> wshift;
    // The unit's steps: step k (4 values) at (k - k0) * 32, block b0's 64 bytes, then b0 + 1's;
    // the unit's stream kAhead ahead, as for int4 above.
    const uint8_t* w = p.weights(e, b0, g, k0);
    prefetch_unit(p, w, g, k0, k1, kAhead);
    __m256i a[kHalves][N];
    for (int i = 0; i < kHalves; ++i)
      for (int j = 0; j < N; ++j) a[i][j] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 4) {
      __m256i xb[N];
      for (int j = 0; j < N; ++j) xb[j] = _mm256_set1_epi32(four(x[j] + k));
#pragma GCC unroll 4
      for (int i = 0; i < kHalves; ++i) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k - k0) * 32 + i * 32)), flip);
        const __m256i mag = _mm256_abs_epi8(v);
        for (int j = 0; j < N; ++j)
          a[i][j] = _mm256_add_epi32(a[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(xb[j], v)), ones));
      }
    }
    scale_unit<N>(p, e, b0, g, xs, k0 >> xshift, a, f);
  }
  store_pair<N>(p, e, b0, f, n, q0, o);
}

// One of the pair dot products above, for inputs q0 .. q0 + N - 1 (N = 1 or 2).
using PairDots = void (*)(const BlockProj&, int64_t, int64_t, const BlockInputs&, const int64_t*,
                          int64_t, int64_t, float*);

// The n inputs two at a time (each weight vector loaded once for both), an odd last one alone.
template <PairDots kTwo, PairDots kOne>
inline void in_twos(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                    const int64_t* idx, int64_t n, float* o) {
  for (int64_t q = 0; q < n; q += 2) {
    if (q + 1 < n) kTwo(p, e, b0, in, idx + q, n, q, o);
    else kOne(p, e, b0, in, idx + q, n, q, o);
  }
}

inline void pair_dots(const BlockProj& p, int64_t e, int64_t b0, const BlockInputs& in,
                      const int64_t* idx, int64_t n, float* o) {
  if (!p.int4) in_twos<int8_block_dots_avx2<2>, int8_block_dots_avx2<1>>(p, e, b0, in, idx, n, o);
  else if (p.z) in_twos<int4_block_dots_avx2<2, true>, int4_block_dots_avx2<1, true>>(p, e, b0, in, idx, n, o);
  else in_twos<int4_block_dots_avx2<2, false>, int4_block_dots_avx2<1, false>>(p, e, b0, in, idx, n, o);
}

}  // namespace moe_dispatch_native
