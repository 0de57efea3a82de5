// The gated activations of the native kernel, by the framework's exact math (moe_dispatch
// reference.activate): one value at a time, and a row of units at once (both builds vectorize
// the ones made of exp: silu, swigluoai, gelu_tanh; gelu's erf stays scalar).

#pragma once

#include "layout.h"

namespace moe_dispatch_native {

constexpr float kSwigluAlpha = 1.702f, kSwigluLimit = 7.f;

inline float activate(int64_t act, float gate, float up) {
  switch (act) {
    case kSilu: return gate / (1.f + std::exp(-gate)) * up;
    case kGelu: return 0.5f * gate * (1.f + std::erf(gate * static_cast<float>(M_SQRT1_2))) * up;
    case kGeluTanh: {
      const float c = std::sqrt(2.f / static_cast<float>(M_PI));
      return 0.5f * gate * (1.f + std::tanh(c * (gate + 0.044715f * gate * gate * gate))) * up;
    }
    default: {  // swigluoai: the gate clamped from above only, as gpt-oss does
      // Operand order keeps a NaN, as torch's clamp does: std::min(a, b) and std::max(a, b)
      // return a when the comparison with a NaN is false.
      const float g = std::min(gate, kSwigluLimit);
      const float u = std::max(std::min(up, kSwigluLimit), -kSwigluLimit);
      return (u + 1.f) * g / (1.f + std::exp(-kSwigluAlpha * g));
    }
  }
}

// e^x per fp32 lane, as 2^n * p(r) with r = x - n ln2 (ln2 in two parts) and Cephes' expf
// polynomial for p: within 2 ulp of std::exp on [-87, 88], where the argument is clamped (so
// n + 127 stays a normal float's exponent, 1 to 254). What the clamp changes against the
// scalar std::exp: e^x of x above 88 is e^88, not infinity, so a gated unit whose gate is
// -inf gives -inf x up (the scalar form, as torch, NaN), and one whose gate is finite below
// -88 gives g x up / e^88 (not 0: different only where |g| is near 1e30). The avx2 build
// makes 2^n from the exponent bits where the avx512 build scales by it (vscalefps).
// Why vectorised in both builds: scalar std::exp per unit was 10-15% of the avx2 build's
// time at decode with int8 / int4 weights (a warm loop on a Zen 3, E=8 top-2 H=1024 I=1408).
#if MD_AVX512
using Floats = __m512;
constexpr int64_t kFloatLanes = 16;
inline Floats vset(float v) { return _mm512_set1_ps(v); }
inline Floats vmax(Floats a, Floats b) { return _mm512_max_ps(a, b); }
inline Floats vmin(Floats a, Floats b) { return _mm512_min_ps(a, b); }
inline Floats vmul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats vadd(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats vdiv(Floats a, Floats b) { return _mm512_div_ps(a, b); }
inline Floats vsub(Floats a, Floats b) { return _mm512_sub_ps(a, b); }
inline Floats vfma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats vfnma(Floats a, Floats b, Floats c) { return _mm512_fnmadd_ps(a, b, c); }
inline Floats vround(Floats a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Floats pow2(Floats p, Floats n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
#else
using Floats = __m256;
constexpr int64_t kFloatLanes = 8;
inline Floats vset(float v) { return _mm256_set1_ps(v); }
inline Floats vmax(Floats a, Floats b) { return _mm256_max_ps(a, b); }
inline Floats vmin(Floats a, Floats b) { return _mm256_min_ps(a, b); }
inline Floats vmul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats vadd(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats vdiv(Floats a, Floats b) { return _mm256_div_ps(a, b); }
inline Floats vsub(Floats a, Floats b) { return _mm256_sub_ps(a, b); }
inline Floats vfma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats vfnma(Floats a, Floats b, Floats c) { return _mm256_fnmadd_ps(a, b, c); }
inline Floats vround(Floats a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Floats pow2(Floats p, Floats n) {  // p * 2^n for an integral n in [-126, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

inline Floats vexp(Floats x) {
  x = vmax(vmin(x, vset(88.f)), vset(-87.f));
  const Floats n = vround(vmul(x, vset(1.44269504f)));
  Floats r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  Floats p = vset(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = vfma(p, r, vset(c));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.f)));
  return pow2(p, n);
}

// g * up / (1 + e^(-k g)): silu (k = 1), the gelu tanh form (0.5 (1 + tanh y) is the logistic
// of 2y), swigluoai's gate term.
inline Floats gated(Floats g, Floats kg, Floats up) {
  return vdiv(vmul(g, up), vadd(vset(1.f), vexp(vsub(vset(0.f), kg))));
}

// The first n (< kFloatLanes in a tail) of v's lanes from / to memory, the others zero / untouched.
#if MD_AVX512
inline Floats fload(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1), p);
}
inline void fstore(float* p, Floats v, int64_t n) {
  _mm512_mask_storeu_ps(p, n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1), v);
}
#else
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Floats fload(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(n));
}
inline void fstore(float* p, Floats v, int64_t n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes_below(n), v);
}
#endif

// out[u] = activate(act, gate[u], up[u]) for u < n: vectorised but for gelu's erf, which
// stays scalar.
inline void activate_units(int64_t act, const float* gate, const float* up, float* out, int64_t n) {
  if (act != kGelu) {
    for (int64_t u = 0; u < n; u += kFloatLanes) {
      const int64_t m = n - u;
      Floats g = fload(gate + u, m), v = fload(up + u, m), y;
      if (act == kSilu) {
        y = gated(g, g, v);
      } else if (act == kGeluTanh) {  // y = 0.5 g (1 + tanh(c (g + 0.044715 g^3)))
        const Floats c = vset(2.f * std::sqrt(2.f / static_cast<float>(M_PI)));
        const Floats in = vfma(vmul(vset(0.044715f), g), vmul(g, g), g);
        y = gated(g, vmul(c, in), v);
      } else {  // swigluoai: the gate clamped from above only, up on both sides
        // vminps / vmaxps return their second operand when either is NaN: the value goes
        // second, so that a NaN passes as torch's clamp passes it.
        g = vmin(vset(kSwigluLimit), g);
        v = vmax(vset(-kSwigluLimit), vmin(vset(kSwigluLimit), v));
        y = gated(g, vmul(vset(kSwigluAlpha), g), vadd(v, vset(1.f)));
      }
      fstore(out + u, y, m);
    }
    return;
  }
  for (int64_t u = 0; u < n; ++u) out[u] = activate(act, gate[u], up[u]);
}

}  // namespace moe_dispatch_native
