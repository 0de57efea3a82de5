// The gated activations of the native kernel, by the framework's exact math (moe_dispatch
// reference.activate): one value at a time, and a row of units at once (the avx512 build
// vectorizes the ones made of exp: silu, swigluoai, gelu_tanh; gelu's erf stays scalar).

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

#if MD_AVX512
// e^x per fp32 lane, as 2^n * p(r) with r = x - n ln2 (ln2 in two parts) and Cephes' expf
// polynomial for p: within 2 ulp of std::exp on [-87, 88], where the argument is clamped.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// g * up / (1 + e^(-k g)): silu (k = 1), the gelu tanh form (0.5 (1 + tanh y) is the logistic
// of 2y), swigluoai's gate term.
inline __m512 gated(__m512 g, __m512 kg, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_div_ps(_mm512_mul_ps(g, up), _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), kg))));
}
#endif

// out[u] = activate(act, gate[u], up[u]) for u < n.
inline void activate_units(int64_t act, const float* gate, const float* up, float* out, int64_t n) {
#if MD_AVX512
  if (act != kGelu) {
    for (int64_t u = 0; u < n; u += 16) {
      const __mmask16 m = n - u >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - u)) - 1);
      __m512 g = _mm512_maskz_loadu_ps(m, gate + u), v = _mm512_maskz_loadu_ps(m, up + u), y;
      if (act == kSilu) {
        y = gated(g, g, v);
      } else if (act == kGeluTanh) {  // y = 0.5 g (1 + tanh(c (g + 0.044715 g^3)))
        const __m512 c = _mm512_set1_ps(2.f * std::sqrt(2.f / static_cast<float>(M_PI)));
        const __m512 in = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g);
        y = gated(g, _mm512_mul_ps(c, in), v);
      } else {  // swigluoai: the gate clamped from above only, up on both sides
        // vminps / vmaxps return their second operand when either is NaN: the value goes
        // second, so that a NaN passes as torch's clamp passes it.
        g = _mm512_min_ps(_mm512_set1_ps(kSwigluLimit), g);
        v = _mm512_max_ps(_mm512_set1_ps(-kSwigluLimit), _mm512_min_ps(_mm512_set1_ps(kSwigluLimit), v));
        y = gated(g, _mm512_mul_ps(_mm512_set1_ps(kSwigluAlpha), g), _mm512_add_ps(v, _mm512_set1_ps(1.f)));
      }
      _mm512_mask_storeu_ps(out + u, m, y);
    }
    return;
  }
#endif
  for (int64_t u = 0; u < n; ++u) out[u] = activate(act, gate[u], up[u]);
}

}  // namespace moe_dispatch_native
