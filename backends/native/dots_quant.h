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

inline float scale_at(const Proj& p, int64_t i) { return p.s16 ? _cvtsh_ss(p.s16[i]) : p.s32[i]; }

// Scales i and i + 1 as [s_i x 4, s_i+1 x 4]: the lanes of a pair_dot.
inline __m256 scale_pair(const Proj& p, int64_t i) {
  if (p.s32) return _mm256_set_m128(_mm_set1_ps(p.s32[i + 1]), _mm_set1_ps(p.s32[i]));
  int32_t bits;
  std::memcpy(&bits, p.s16 + i, sizeof bits);
  const __m128i two = _mm_cvtsi32_si128(bits);
  return _mm256_cvtph_ps(_mm_shuffle_epi8(two, _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3)));
}

// scale x zero point of groups i..i+7 (the constant offset when there are no zero points).
inline __m256 scaled_zeros8(const Proj& p, int64_t i) {
  const __m256 s = p.s16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.s16 + i)))
                         : _mm256_loadu_ps(p.s32 + i);
  if (!p.z) return _mm256_mul_ps(s, _mm256_set1_ps(static_cast<float>(p.offset)));
  const __m128i z = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.z + i));
  return _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z)));
}

// Rows r0 and r1 of an int8 projection dotted with kN (1 or 2) input vectors idx[n], into
// o = {r0.x0, r1.x0, r0.x1, r1.x1}. Each block's int32 dot is scaled by the input block's
// scale alone (one broadcast for both rows), the weight scale applied once per group. With
// two inputs each weight block is loaded once for both; every input's sums run in the
// one-input order, so a token's result does not depend on its neighbour.
template <int kN>
void dot_int8(const Proj& p, int64_t e, int64_t r0, int64_t r1, const Inputs& in,
              const int64_t* idx, float* o) {
  const int64_t nb = p.kp / kBlock;
  const int64_t g0 = (e * p.rows + r0) * p.groups, g1 = (e * p.rows + r1) * p.groups;
  const int8_t* w0 = reinterpret_cast<const int8_t*>(p.row(e, r0));
  const int8_t* w1 = reinterpret_cast<const int8_t*>(p.row(e, r1));
  __m256 acc0[kN], acc1[kN];
  for (int n = 0; n < kN; ++n) acc0[n] = acc1[n] = _mm256_setzero_ps();
  for (int64_t lo = 0, g = 0; lo < nb; lo += p.bpg, ++g) {
    const int64_t hi = std::min(nb, lo + p.bpg);
    __m256 part0[kN], part1[kN];
    for (int n = 0; n < kN; ++n) part0[n] = part1[n] = _mm256_setzero_ps();
    for (int64_t b = lo; b < hi; ++b) {
      if ((b & 1) == 0) {  // once per 64 bytes of each row
        prefetch(w0 + b * kBlock);
        prefetch(w1 + b * kBlock);
      }
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * kBlock));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * kBlock));
      const __m256i u0 = _mm256_sign_epi8(v0, v0), u1 = _mm256_sign_epi8(v1, v1);
      for (int n = 0; n < kN; ++n) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q.data() + idx[n] * p.kp + b * kBlock));
        const __m256 scale = _mm256_broadcast_ss(in.d.data() + idx[n] * nb + b);
        part0[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(u0, _mm256_sign_epi8(x, v0))), scale, part0[n]);
        part1[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(u1, _mm256_sign_epi8(x, v1))), scale, part1[n]);
      }
    }
    const __m256 s0 = _mm256_set1_ps(scale_at(p, g0 + g)), s1 = _mm256_set1_ps(scale_at(p, g1 + g));
    for (int n = 0; n < kN; ++n) {
      acc0[n] = _mm256_fmadd_ps(part0[n], s0, acc0[n]);
      acc1[n] = _mm256_fmadd_ps(part1[n], s1, acc1[n]);
    }
  }
  for (int n = 0; n < kN; ++n) o[2 * n] = hsum(acc0[n]), o[2 * n + 1] = hsum(acc1[n]);
}

// The int4 blocks of rows w0 and w1, two at a time (an odd last block alone): one 32-byte
// load and three ops unpack two blocks of a row (one block alone takes five). Each pair's
// int32 dots are scaled by input scale x weight scale in one vector: kOwn, blocks of 32 with
// a weight scale each (GGUF Q4_0), the pair's two scales; otherwise its group's one scale,
// converted once per group (a pair never straddles two: groups are of even blocks). Measured
// on a Zen 3: one multiply more per pair, and no per-group sums to scale and add, made int4
// g128 14-15% faster at C2 T=1 and T=8.
template <int kN, bool kOwn>
inline void int4_blocks(const Proj& p, const uint8_t* w0, const uint8_t* w1, int64_t g0,
                        int64_t g1, const Inputs& in, const int64_t* idx, __m256* acc0,
                        __m256* acc1) {
  const int64_t nb = p.kp / kBlock;
  const __m256i m = _mm256_set1_epi8(0x0F);
  __m256 ws0 = _mm256_setzero_ps(), ws1 = ws0;
  int64_t b = 0;
  for (int64_t next = 0, g = 0; b + 1 < nb; b += 2) {
    if ((b & 3) == 0) {  // 64 bytes of each row per two pairs
      prefetch(w0 + b * 16);
      prefetch(w1 + b * 16);
    }
    if constexpr (kOwn) {
      ws0 = scale_pair(p, g0 + b), ws1 = scale_pair(p, g1 + b);
    } else if (b == next) {
      ws0 = _mm256_set1_ps(scale_at(p, g0 + g)), ws1 = _mm256_set1_ps(scale_at(p, g1 + g));
      ++g, next += p.bpg;
    }
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * 16));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * 16));
    const __m256i lo0 = _mm256_and_si256(v0, m), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m);
    const __m256i lo1 = _mm256_and_si256(v1, m), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m);
    for (int n = 0; n < kN; ++n) {
      const int8_t* x = in.q.data() + idx[n] * p.kp + b * kBlock;
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      const __m256 xs = _mm256_loadu_ps(in.d4.data() + (idx[n] * nb + b) * 4);
      acc0[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(lo0, hi0, x1, x2)), _mm256_mul_ps(xs, ws0), acc0[n]);
      acc1[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot(lo1, hi1, x1, x2)), _mm256_mul_ps(xs, ws1), acc1[n]);
    }
  }
  if (b < nb) {  // an odd last block of the row, as Inputs left it
    const __m256i u0 = int4_block(w0 + b * 16), u1 = int4_block(w1 + b * 16);
    const int64_t g = b / p.bpg;
    const float s0 = scale_at(p, g0 + g), s1 = scale_at(p, g1 + g);
    for (int n = 0; n < kN; ++n) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q.data() + idx[n] * p.kp + b * kBlock));
      const float xs = in.d[idx[n] * nb + b];
      acc0[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(u0, x)), _mm256_set1_ps(xs * s0), acc0[n]);
      acc1[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(u1, x)), _mm256_set1_ps(xs * s1), acc1[n]);
    }
  }
}

// Rows r0 and r1 of an int4 projection with kN inputs, as dot_int8. value = (u - zero) *
// scale, so a row's dot is sum_g scale_g * (sum(u * x) - zero_g * sum_g(x)): the integer
// dots as above, and the zero-point term once per row from the inputs' group sums (Inputs
// gs), eight groups a vector. Measured on a Zen 3: the per-block and per-group scalar work
// (scale conversions, the correction) had made int4 slower than int8 at C2 T=1.
template <int kN>
void dot_int4(const Proj& p, int64_t e, int64_t r0, int64_t r1, const Inputs& in,
              const int64_t* idx, float* o) {
  const int64_t nb = p.kp / kBlock;
  const int64_t g0 = (e * p.rows + r0) * p.groups, g1 = (e * p.rows + r1) * p.groups;
  __m256 acc0[kN], acc1[kN];
  for (int n = 0; n < kN; ++n) acc0[n] = acc1[n] = _mm256_setzero_ps();
  if (p.bpg == 1) int4_blocks<kN, true>(p, p.row(e, r0), p.row(e, r1), g0, g1, in, idx, acc0, acc1);
  else int4_blocks<kN, false>(p, p.row(e, r0), p.row(e, r1), g0, g1, in, idx, acc0, acc1);
  // The zero-point term: its vector part subtracted before the sums, the rest after.
  const int64_t groups = (nb + p.bpg - 1) / p.bpg, vec = groups & ~int64_t{7};
  for (int64_t g = 0; g < vec; g += 8) {
    const __m256 z0 = scaled_zeros8(p, g0 + g), z1 = scaled_zeros8(p, g1 + g);
    for (int n = 0; n < kN; ++n) {
      const __m256 xs = _mm256_loadu_ps(in.gs.data() + idx[n] * in.groups + g);
      acc0[n] = _mm256_fnmadd_ps(z0, xs, acc0[n]);
      acc1[n] = _mm256_fnmadd_ps(z1, xs, acc1[n]);
    }
  }
  for (int n = 0; n < kN; ++n) {
    float c0 = 0.f, c1 = 0.f;
    for (int64_t g = vec; g < groups; ++g) {
      const float xs = in.gs[idx[n] * in.groups + g];
      c0 += scale_at(p, g0 + g) * static_cast<float>(p.z ? p.z[g0 + g] : p.offset) * xs;
      c1 += scale_at(p, g1 + g) * static_cast<float>(p.z ? p.z[g1 + g] : p.offset) * xs;
    }
    o[2 * n] = hsum(acc0[n]) - c0;
    o[2 * n + 1] = hsum(acc1[n]) - c1;
  }
}

}  // namespace moe_dispatch_native
