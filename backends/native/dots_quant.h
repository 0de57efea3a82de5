// int8 weights in the avx2 build: two rows dotted with one or two inputs quantized per block
// of 32, in exact int32 block dot products scaled in fp32. (int4 weights, and the avx512
// build's int8, run in blocks of 16 rows: blocks_quant.h.)

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

inline float scale_at(const Proj& p, int64_t i) { return p.s16 ? _cvtsh_ss(p.s16[i]) : p.s32[i]; }

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

}  // namespace moe_dispatch_native
