// The avx512 build's blocks (blocks_quant.h): BlockInputs::set and the pair dot products, one
// vpdpbusd for 16 rows by one input (int8 and int4).

#pragma once

#include "blocks_quant.h"

namespace moe_dispatch_native {

inline void BlockInputs::set(int64_t i, const float* v, int64_t len) {
  int8_t* out = q.data() + i * kp;
  int32_t* su = sum.data() + i * units;
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
    // Below 127 / FLT_MAX, 127 / amax is infinite: the group is taken as zeros (as in the avx2 build).
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
}

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(four(p)); }

// Software prefetch of a pair's stream, this far ahead (past the pair's end into the next
// pair in memory: the thread's next one, except at the end of its range of an expert's
// blocks), a unit at a time (blocks_quant.h, prefetch_unit). Why: as in the avx2 build
// (blocks_avx2.h), a cold call otherwise computes and waits for memory in turn (measured on a
// Zen 5, family 26, model 2, in its earlier form: without it 1.01-1.25x of the time in int4).
// Why 6 KiB: where one core's own streaming is the bound (one thread, or two that do not
// saturate the memory) the loop must keep as many lines in flight as a plain read does, about
// 40 GB/s x 150 ns. On that Zen 5, step 2's loop alone against a plain read of its bytes on
// one thread (benchmarks/bench_stream.py, C2, int8 / int4 g128 / int4 g32): 4096 bytes ahead
// 0.948-0.976x of the read's speed, 6144 1.010-1.038x, 8192 0.997-1.040x. In the whole
// kernel, 6144 against 4096 (bench_native_ab.py, 60-80 rounds): 0.958-0.974x of the time in
// the rounds where the memory read fast (C2 T=1-8 int4), 0.996-1.033x where two threads
// saturated it.
constexpr int64_t kBlockAhead = 6144;

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
  __m512 f[R][N];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int n = 0; n < N; ++n) f[r][n] = _mm512_setzero_ps();
  const bool per_row = p.group >= p.kp;
  for (int64_t u = 0; u < in.units; ++u) {
    const int64_t k0 = u * in.unit, k1 = std::min(p.kp, k0 + in.unit), g = k0 / p.group;
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) w[r] = p.weights(e, b0, g, k0) + r * 64;  // the pair's blocks interleave
    prefetch_unit(p, w[0], g, k0, k1, kBlockAhead);
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
          const __m512i v = _mm512_loadu_si512(w[r] + (k - k0) * 16);
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
          const __m512i v = _mm512_loadu_si512(w[r] + (k - k0) * 32);
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

}  // namespace moe_dispatch_native
