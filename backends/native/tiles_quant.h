// int8 / int4 weights at larger token counts (avx512 build only): two rows times up to six
// inputs per tile, so that every weight vector loaded feeds six integer dot products and
// every input vector two, instead of the two-by-two of dots_quant.h.
//
// The arithmetic is shaped by what Zen 4 runs fast (measured in a standalone loop, one
// core): vpdpbusd into int32 at about 210 GMAC/s when nothing else is in the loop, but half
// that when each 64-value step's int32 sums are converted and scaled in fp32, as blocks of
// 32 with a scale each require (the conversion's FMA competes with vpdpbusd for the same
// pipes). So the inputs here are quantized per group of 128 values (one fp32 scale each,
// kGroup), the int32 sums run over a whole unit (128 values, or the weight group if that is
// smaller) and are scaled once per unit: about 140 GMAC/s. The error is larger than with
// blocks of 32 (measured on random data against the float64 reference on the dequantized
// weights: 1.6e-2 against 1.2e-2; the backend's bound is 2e-2): kernel.cpp uses these tiles
// above kLoopTokens tokens, where the GEMM's speed is what counts.
//
// vpdpbusd multiplies unsigned by signed bytes: the inputs are stored as q + 128 (0..255)
// and the weights stay signed (int8 as stored; int4 as u - zero, -15..15), so each unit's
// sum carries 128 x the sum of its weights, which Proj.wsum holds (computed once at
// construction) and which starts the unit's int32 sum, negated.

#pragma once

#include "dots_quant.h"

namespace moe_dispatch_native {

#if MD_AVX512

constexpr int64_t kStep = 64;  // values per vpdpbusd step (one 512-bit load)

// The unit of a projection (values per scaled int32 sum), or 0 where the tiles do not
// apply: the reduction axis in steps of 64, and a weight group of at least 64 values that
// no unit straddles (per channel: one group for the whole row).
inline int64_t tile_unit(int64_t kp, int64_t bpg) {
  const int64_t group = bpg * kBlock, unit = std::min(kGroup, group);
  if (kp % kStep != 0 || group < kStep) return 0;
  if (group < kp && group % unit != 0) return 0;
  return unit;
}

// Proj.unit and Proj.wsum of a projection whose other fields are set (Experts' constructor).
inline void tile_prepare(Proj& p, int64_t fmt, int64_t experts) {
  p.unit = fmt == kBf16 ? 0 : tile_unit(p.kp, p.bpg);
  if (p.unit == 0) return;
  const int64_t units = (p.kp + p.unit - 1) / p.unit, group = p.bpg * kBlock;
  p.wsum.assign(experts * p.rows * units, 0);
  at::parallel_for(0, experts * p.rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t er = lo; er < hi; ++er) {
      const uint8_t* w = p.base + er * p.row_bytes;
      for (int64_t u = 0; u < units; ++u) {
        const int64_t k0 = u * p.unit, k1 = std::min(p.kp, k0 + p.unit);
        int32_t sum = 0;
        if (fmt == kInt4) {
          for (int64_t b = k0 / 2; b < k1 / 2; ++b) sum += (w[b] & 0x0F) + (w[b] >> 4);
          sum -= static_cast<int32_t>(p.z ? p.z[er * p.groups + k0 / group] : p.offset) * (k1 - k0);
        } else {
          for (int64_t k = k0; k < k1; ++k) sum += reinterpret_cast<const int8_t*>(w)[k];
        }
        p.wsum[er * units + u] = static_cast<int16_t>(sum);
      }
    }
  });
}

// A step's 64 int4 values of a row, u - zero as signed bytes in int4_slot's order: the 32
// bytes loaded into both halves at once, the upper half shifted right by 4 (one variable
// shift), both masked to their low nibbles (three ops where a load per half took five).
inline __m512i int4_step(const uint8_t* p, __m512i zero) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
  const __m512i u = _mm512_and_si512(_mm512_srlv_epi64(v, shift), _mm512_set1_epi8(0x0F));
  return _mm512_sub_epi8(u, zero);
}

// One unit (kSteps steps of 64 values from k0) of rows w0 and w1 with N inputs, into the int32
// sums a0 and a1. Inlined with constant trip counts so that the sums stay in registers.
template <int N, int kSteps, bool kInt4>
__attribute__((always_inline)) inline void unit_dots(const uint8_t* w0, const uint8_t* w1,
                                                     const uint8_t* const* x, int64_t k0,
                                                     __m512i z0, __m512i z1, __m512i* a0,
                                                     __m512i* a1) {
#pragma GCC unroll 2
  for (int s = 0; s < kSteps; ++s) {
    const int64_t k = k0 + s * kStep;
    __m512i v0, v1;
    if constexpr (kInt4) {
      v0 = int4_step(w0 + k / 2, z0), v1 = int4_step(w1 + k / 2, z1);
    } else {
      v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
    }
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) {
      const __m512i xv = _mm512_loadu_si512(x[n] + k);
      a0[n] = _mm512_dpbusd_epi32(a0[n], xv, v0);
      a1[n] = _mm512_dpbusd_epi32(a1[n], xv, v1);
    }
  }
}

// Rows r0 and r1 of expert e dotted with N (1..kTile) wide inputs idx[n], into
// o = {r0.x0, r1.x0, r0.x1, r1.x1, ...} as row_dot2x2 writes them. sx: the inputs' scales
// side by side per group (WideInputs::gather), so that a unit's scales are one vector.
template <int N, bool kInt4, bool kRowScale>
void tile_dots(const Proj& p, int64_t e, int64_t r0, int64_t r1, const WideInputs& in,
               const int64_t* idx, const float* sx, float* o) {
  const int64_t unit = p.unit, units = (p.kp + unit - 1) / unit, group = p.bpg * kBlock;
  const uint8_t* w0 = p.row(e, r0);
  const uint8_t* w1 = p.row(e, r1);
  const int16_t* c0 = p.wsum.data() + (e * p.rows + r0) * units;
  const int16_t* c1 = p.wsum.data() + (e * p.rows + r1) * units;
  const int64_t g0 = (e * p.rows + r0) * p.groups, g1 = (e * p.rows + r1) * p.groups;
  const uint8_t* x[N];
#pragma GCC unroll 6
  for (int n = 0; n < N; ++n) x[n] = in.q.data() + idx[n] * in.kp;
  __m512 f0[N], f1[N];
#pragma GCC unroll 6
  for (int n = 0; n < N; ++n) f0[n] = f1[n] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const int64_t k0 = u * unit, g = k0 / group;
    const __m512i start0 = _mm512_maskz_set1_epi32(1, -128 * static_cast<int32_t>(c0[u]));
    const __m512i start1 = _mm512_maskz_set1_epi32(1, -128 * static_cast<int32_t>(c1[u]));
    __m512i a0[N], a1[N];
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) a0[n] = start0, a1[n] = start1;
    __m512i z0 = _mm512_setzero_si512(), z1 = z0;
    if constexpr (kInt4) {
      z0 = _mm512_set1_epi8(static_cast<char>(p.z ? p.z[g0 + g] : p.offset));
      z1 = _mm512_set1_epi8(static_cast<char>(p.z ? p.z[g1 + g] : p.offset));
    }
    // A unit is 128 values (two steps) or 64; the last one of a row may be 64 either way.
    if (std::min(p.kp - k0, unit) == 2 * kStep) unit_dots<N, 2, kInt4>(w0, w1, x, k0, z0, z1, a0, a1);
    else unit_dots<N, 1, kInt4>(w0, w1, x, k0, z0, z1, a0, a1);
    // Scaled once per unit: by the input's scale (a broadcast from memory), and with weight
    // groups by the row's scale too, both products of a row made by one multiply of the
    // unit's scales; a per-row scale is applied once, after the sums.
    const float* su = sx + (k0 / kGroup) * kTile8;
    if constexpr (kRowScale) {
#pragma GCC unroll 6
      for (int n = 0; n < N; ++n) {
        const __m512 s = _mm512_set1_ps(su[n]);
        f0[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[n]), s, f0[n]);
        f1[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[n]), s, f1[n]);
      }
    } else {
      alignas(32) float p0[kTile8], p1[kTile8];
      const __m256 v = _mm256_loadu_ps(su);
      _mm256_store_ps(p0, _mm256_mul_ps(v, _mm256_set1_ps(scale_at(p, g0 + g))));
      _mm256_store_ps(p1, _mm256_mul_ps(v, _mm256_set1_ps(scale_at(p, g1 + g))));
      asm volatile("" ::: "memory");  // read them back as broadcasts from memory, not shuffles
#pragma GCC unroll 6
      for (int n = 0; n < N; ++n) {
        f0[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[n]), _mm512_set1_ps(p0[n]), f0[n]);
        f1[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[n]), _mm512_set1_ps(p1[n]), f1[n]);
      }
    }
  }
  const float s0 = kRowScale ? scale_at(p, g0) : 1.f, s1 = kRowScale ? scale_at(p, g1) : 1.f;
#pragma GCC unroll 6
  for (int n = 0; n < N; ++n) {
    o[2 * n] = s0 * _mm512_reduce_add_ps(f0[n]);
    o[2 * n + 1] = s1 * _mm512_reduce_add_ps(f1[n]);
  }
}

template <bool kInt4, bool kRowScale>
inline void tile_dots_n(const Proj& p, int64_t e, int64_t r0, int64_t r1, const WideInputs& in,
                        const int64_t* idx, int64_t n, const float* sx, float* o) {
  switch (n) {
    case 1: return tile_dots<1, kInt4, kRowScale>(p, e, r0, r1, in, idx, sx, o);
    case 2: return tile_dots<2, kInt4, kRowScale>(p, e, r0, r1, in, idx, sx, o);
    case 3: return tile_dots<3, kInt4, kRowScale>(p, e, r0, r1, in, idx, sx, o);
    case 4: return tile_dots<4, kInt4, kRowScale>(p, e, r0, r1, in, idx, sx, o);
    case 5: return tile_dots<5, kInt4, kRowScale>(p, e, r0, r1, in, idx, sx, o);
    default: return tile_dots<6, kInt4, kRowScale>(p, e, r0, r1, in, idx, sx, o);
  }
}

// Rows r0 and r1 with n (1..kTile) wide inputs and their gathered scales (dots.h's rows_dots).
inline void tile_rows(int64_t fmt, const Proj& p, int64_t e, int64_t r0, int64_t r1,
                      const WideInputs& in, const int64_t* idx, int64_t n, const float* sx,
                      float* o) {
  if (fmt == kInt4) tile_dots_n<true, false>(p, e, r0, r1, in, idx, n, sx, o);
  else if (p.groups == 1) tile_dots_n<false, true>(p, e, r0, r1, in, idx, n, sx, o);
  else tile_dots_n<false, false>(p, e, r0, r1, in, idx, n, sx, o);
}

#endif  // MD_AVX512

}  // namespace moe_dispatch_native
