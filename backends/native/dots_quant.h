// int8 / int4 weights: two rows dotted with one or two inputs quantized per block of 32,
// in exact int32 block dot products scaled in fp32.

#pragma once

#include "layout.h"

namespace moe_dispatch_native {

// sum over 32 products of unsigned u (0..255, at most 128 for |int8|) and signed x.
inline __m256i block_dot(__m256i u, __m256i x) {
#if MD_AVX512
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

inline __m256i int4_block(const uint8_t* p) {  // 16 bytes -> 32 values 0..15 in order
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// Two int4 blocks' dots at once: lo and hi hold the low and high nibbles of 32 bytes (blocks
// A and B), x1 and x2 the inputs in Inputs' paired order; int32 lanes 0-3 sum A, 4-7 B.
// On AVX2 the two maddubs sums add as int16 first (4 products of at most 15 x 127).
inline __m256i pair_dot(__m256i lo, __m256i hi, __m256i x1, __m256i x2) {
#if MD_AVX512
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x1), hi, x2);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x1), _mm256_maddubs_epi16(hi, x2)),
                           _mm256_set1_epi16(1));
#endif
}

// dot_quant's int4 blocks [lo, hi) of one group, hi - lo even, two at a time: one 32-byte
// load and three ops unpack two blocks of a row (one block alone takes five). Measured
// on a Zen 3 at C2 T=1: int4 was bound by this arithmetic at 45% of the DRAM read.
template <int kN>
inline void int4_pairs(const uint8_t* w0, const uint8_t* w1, const int8_t* const* xq,
                       const float* const* x4, int64_t lo, int64_t hi, __m256* part0,
                       __m256* part1) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  for (int64_t b = lo; b < hi; b += 2) {
    if ((b & 3) == 0) {  // 64 bytes of each row per two pairs
      prefetch(w0 + b * 16);
      prefetch(w1 + b * 16);
    }
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * 16));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * 16));
    const __m256i lo0 = _mm256_and_si256(v0, m), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m);
    const __m256i lo1 = _mm256_and_si256(v1, m), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m);
    for (int n = 0; n < kN; ++n) {
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[n] + b * kBlock));
      const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[n] + b * kBlock + 32));
      const __m256 scale = _mm256_loadu_ps(x4[n] + b * 4);
      part0[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(lo0, hi0, x1, x2)), scale, part0[n]);
      part1[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(lo1, hi1, x1, x2)), scale, part1[n]);
    }
  }
}

// Rows r0 and r1 of a quantized projection dotted with kN (1 or 2) input vectors idx[n],
// into o = {r0.x0, r1.x0, r0.x1, r1.x1}. Per group of blocks sharing a weight scale, each
// block's int32 dot is scaled by the input block's scale alone (one broadcast for both
// rows); the weight scale and the int4 zero-point correction are applied once per group.
// Measured on a Zen 3: the per-block scalar work (two scale loads and conversions, two
// products and the correction per row) had made int4 slower than int8 at C2 T=1. With two
// inputs each weight block is loaded and unpacked once for both; every input's sums run in
// the one-input order, so a token's result does not depend on its neighbour.
template <bool kFour, int kN>
void dot_quant(const Proj& p, int64_t e, int64_t r0, int64_t r1, const Inputs& in,
               const int64_t* idx, float* o) {
  const int64_t nb = p.kp / kBlock, bw = kFour ? kBlock / 2 : kBlock;  // bytes per block
  const int64_t lines = kFour ? 3 : 1;  // prefetch once per 64 bytes: every 4 or 2 blocks
  const int64_t g0 = (e * p.rows + r0) * p.groups, g1 = (e * p.rows + r1) * p.groups;
  const uint8_t* w0 = p.row(e, r0);
  const uint8_t* w1 = p.row(e, r1);
  const int8_t* xq[kN];
  const float* xd[kN];
  const float* xs[kN];
  const float* x4[kN];
  __m256 acc0[kN], acc1[kN];
  float corr0[kN], corr1[kN];
  for (int n = 0; n < kN; ++n) {
    xq[n] = in.q.data() + idx[n] * p.kp;
    xd[n] = in.d.data() + idx[n] * nb;
    xs[n] = in.sd.data() + idx[n] * nb;
    x4[n] = p.paired ? in.d4.data() + idx[n] * nb * 4 : nullptr;
    acc0[n] = acc1[n] = _mm256_setzero_ps();
    corr0[n] = corr1[n] = 0.f;
  }
  for (int64_t lo = 0, g = 0; lo < nb; lo += p.bpg, ++g) {
    const int64_t hi = std::min(nb, lo + p.bpg);
    __m256 part0[kN], part1[kN];
    float xsum[kN];
    for (int n = 0; n < kN; ++n) part0[n] = part1[n] = _mm256_setzero_ps(), xsum[n] = 0.f;
    int64_t b = lo;
    if (kFour && p.paired) {  // pairs of blocks; an odd last one goes through the loop below
      b = lo + ((hi - lo) & ~int64_t{1});
      int4_pairs<kN>(w0, w1, xq, x4, lo, b, part0, part1);
      for (int n = 0; n < kN; ++n)
        for (int64_t k = lo; k < b; ++k) xsum[n] += xs[n][k];
    }
    for (; b < hi; ++b) {
      if ((b & lines) == 0) {
        prefetch(w0 + b * bw);
        prefetch(w1 + b * bw);
      }
      __m256i u0, u1, v0, v1;
      if constexpr (kFour) {
        u0 = int4_block(w0 + b * bw);
        u1 = int4_block(w1 + b * bw);
      } else {
        v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * bw));
        v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * bw));
        u0 = _mm256_sign_epi8(v0, v0);
        u1 = _mm256_sign_epi8(v1, v1);
      }
      for (int n = 0; n < kN; ++n) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[n] + b * kBlock));
        __m256i d0, d1;
        if constexpr (kFour) {
          d0 = block_dot(u0, x);
          d1 = block_dot(u1, x);
          xsum[n] += xs[n][b];
        } else {
          d0 = block_dot(u0, _mm256_sign_epi8(x, v0));
          d1 = block_dot(u1, _mm256_sign_epi8(x, v1));
        }
        const __m256 scale = _mm256_broadcast_ss(xd[n] + b);
        part0[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), scale, part0[n]);
        part1[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), scale, part1[n]);
      }
    }
    const float s0 = p.s16 ? _cvtsh_ss(p.s16[g0 + g]) : p.s32[g0 + g];
    const float s1 = p.s16 ? _cvtsh_ss(p.s16[g1 + g]) : p.s32[g1 + g];
    const __m256 sv0 = _mm256_set1_ps(s0), sv1 = _mm256_set1_ps(s1);
    for (int n = 0; n < kN; ++n) {
      acc0[n] = _mm256_fmadd_ps(part0[n], sv0, acc0[n]);
      acc1[n] = _mm256_fmadd_ps(part1[n], sv1, acc1[n]);
      if constexpr (kFour) {
        corr0[n] += s0 * static_cast<float>(p.z ? p.z[g0 + g] : p.offset) * xsum[n];
        corr1[n] += s1 * static_cast<float>(p.z ? p.z[g1 + g] : p.offset) * xsum[n];
      }
    }
  }
  for (int n = 0; n < kN; ++n) {
    o[2 * n] = hsum(acc0[n]) - corr0[n];
    o[2 * n + 1] = hsum(acc1[n]) - corr1[n];
  }
}

}  // namespace moe_dispatch_native
