// bf16 weights: two rows dotted with one or two inputs; fp32 sums (vdpbf16ps with AVX512-BF16,
// widened in registers and FMA on AVX2).

#pragma once

#include "layout.h"

namespace moe_dispatch_native {

#if MD_AVX512
// AVX512-BF16: vdpbf16ps multiplies 32 bf16 weights by 32 bf16 inputs and adds the pairs into
// 16 fp32 lanes, one instruction per input where widening and two FMAs took four (the bf16
// products are exact in fp32). The weights need no widening, so an expert's rows reused from
// L1 by its 2-16 routed tokens cost one instruction per 32 weights and token (two where the
// input carries a remainder: Inputs::lo).
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512bh load_bh(const uint16_t* p) { return as_bh(_mm512_loadu_si512(p)); }

// Rows w0 and w1 dotted with kN inputs x[n] (remainders xlo[n] when kLo), into
// o = {w0.x0, w1.x0, w0.x1, w1.x1}: each weight vector is loaded once for every input, and
// every input's sums run in the one-input order, so a token's result does not depend on
// its neighbour.
template <int kN, bool kLo>
void dots_bf16(const uint16_t* w0, const uint16_t* w1, const BfInput* const* x,
               const BfInput* const* xlo, int64_t kp, float* o) {
  __m512 acc0[kN], acc1[kN];
  for (int n = 0; n < kN; ++n) acc0[n] = acc1[n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; k += 32) {
    prefetch(w0 + k);
    prefetch(w1 + k);
    const __m512bh v0 = load_bh(w0 + k), v1 = load_bh(w1 + k);
    for (int n = 0; n < kN; ++n) {
      const __m512bh xv = load_bh(x[n] + k);
      acc0[n] = _mm512_dpbf16_ps(acc0[n], v0, xv);
      acc1[n] = _mm512_dpbf16_ps(acc1[n], v1, xv);
      if constexpr (kLo) {
        const __m512bh xr = load_bh(xlo[n] + k);
        acc0[n] = _mm512_dpbf16_ps(acc0[n], v0, xr);
        acc1[n] = _mm512_dpbf16_ps(acc1[n], v1, xr);
      }
    }
  }
  for (int n = 0; n < kN; ++n)
    o[2 * n] = _mm512_reduce_add_ps(acc0[n]), o[2 * n + 1] = _mm512_reduce_add_ps(acc1[n]);
}

// Rows w0 and w1 dotted with one input x (bf16; xlo its remainder, or null), into o[0], o[1].
void dot2_bf16(const uint16_t* w0, const uint16_t* w1, const BfInput* x, const BfInput* xlo,
               int64_t kp, float* o) {
  if (xlo) dots_bf16<1, true>(w0, w1, &x, &xlo, kp, o);
  else dots_bf16<1, false>(w0, w1, &x, &xlo, kp, o);
}

// Rows w0 and w1 dotted with two inputs x0 and x1 (remainders x0lo, x1lo, or null), into
// o = {w0.x0, w1.x0, w0.x1, w1.x1}.
void dot2x2_bf16(const uint16_t* w0, const uint16_t* w1, const BfInput* x0, const BfInput* x1,
                 const BfInput* x0lo, const BfInput* x1lo, int64_t kp, float* o) {
  const BfInput* x[2] = {x0, x1};
  const BfInput* xlo[2] = {x0lo, x1lo};
  if (x0lo) dots_bf16<2, true>(w0, w1, x, xlo, kp, o);
  else dots_bf16<2, false>(w0, w1, x, xlo, kp, o);
}
#else
// AVX2: each 32-bit lane of a weight vector holds two bf16 values; a shift left by 16 widens
// the even one to fp32, a mask the odd one, each met by its inputs (interleaved fp32, so
// there is no remainder: the unnamed pointers are always null).

// Rows w0 and w1 dotted with one input, into o[0], o[1].
void dot2_bf16(const uint16_t* w0, const uint16_t* w1, const BfInput* x, const BfInput*,
               int64_t kp, float* o) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < kp; k += 16) {
    if ((k & 31) == 0) {  // one cache line of each row per 32 values
      prefetch(w0 + k);
      prefetch(w1 + k);
    }
    const __m256 xe = _mm256_loadu_ps(x + k), xo = _mm256_loadu_ps(x + k + 8);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), xe, a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, mask)), xo, a1);
    b0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), xe, b0);
    b1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, mask)), xo, b1);
  }
  o[0] = hsum(_mm256_add_ps(a0, a1));
  o[1] = hsum(_mm256_add_ps(b0, b1));
}

// Rows w0 and w1 dotted with two inputs x0 and x1, into o = {w0.x0, w1.x0, w0.x1, w1.x1}:
// each weight vector is widened once for both inputs (an expert's second routed token costs
// FMAs, not a second widening and load). Every sum runs in dot2_bf16's exact order, so a
// token's result does not depend on its neighbour.
void dot2x2_bf16(const uint16_t* w0, const uint16_t* w1, const BfInput* x0, const BfInput* x1,
                 const BfInput*, const BfInput*, int64_t kp, float* o) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < kp; k += 16) {
    if ((k & 31) == 0) {
      prefetch(w0 + k);
      prefetch(w1 + k);
    }
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k));
    const __m256 w0e = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 w0o = _mm256_castsi256_ps(_mm256_and_si256(v0, mask));
    const __m256 w1e = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    const __m256 w1o = _mm256_castsi256_ps(_mm256_and_si256(v1, mask));
    a0 = _mm256_fmadd_ps(w0e, _mm256_loadu_ps(x0 + k), a0);
    a1 = _mm256_fmadd_ps(w0o, _mm256_loadu_ps(x0 + k + 8), a1);
    b0 = _mm256_fmadd_ps(w1e, _mm256_loadu_ps(x0 + k), b0);
    b1 = _mm256_fmadd_ps(w1o, _mm256_loadu_ps(x0 + k + 8), b1);
    c0 = _mm256_fmadd_ps(w0e, _mm256_loadu_ps(x1 + k), c0);
    c1 = _mm256_fmadd_ps(w0o, _mm256_loadu_ps(x1 + k + 8), c1);
    d0 = _mm256_fmadd_ps(w1e, _mm256_loadu_ps(x1 + k), d0);
    d1 = _mm256_fmadd_ps(w1o, _mm256_loadu_ps(x1 + k + 8), d1);
  }
  o[0] = hsum(_mm256_add_ps(a0, a1));
  o[1] = hsum(_mm256_add_ps(b0, b1));
  o[2] = hsum(_mm256_add_ps(c0, c1));
  o[3] = hsum(_mm256_add_ps(d0, d1));
}
#endif

}  // namespace moe_dispatch_native
