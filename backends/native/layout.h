// The native kernel's layouts (included by the dot-product headers): the ISA of this build,
// the weight and input layouts, the prefetch. kernel.py names every header of the kernel in
// its build (NativeExtension), so that an edit here rebuilds.

#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define MD_AVX512 1
constexpr const char* kIsa = "avx512";
constexpr int64_t kLanes = 32;  // bf16 values per 512-bit load
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MD_AVX512 0
constexpr const char* kIsa = "avx2";
constexpr int64_t kLanes = 16;
#else
#error "kernel.cpp is built with -mavx2 -mfma -mf16c at least (kernel.py sets the flags)"
#endif

namespace moe_dispatch_native {

enum Format : int64_t { kBf16 = 0, kInt8 = 1, kInt4 = 2 };
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kSwigluOai = 3 };
constexpr int64_t kBlock = 32;  // values per quantization block
constexpr int64_t kUnits = 16;  // intermediate units per work item of step 2
constexpr int64_t kCols = 16;   // output columns per work item of step 4
constexpr int64_t kTile = 6;    // inputs per call of rows_dots (dots.h) and pair_dots (blocks_avx*.h)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One projection of bf16 weights in rows; raw pointers resolved once (a Tensor accessor per
// row costs more than the row's arithmetic: measured 8 ms per C2 call with them).
struct Proj {
  at::Tensor q;  // held for its storage
  const uint8_t* base = nullptr;
  int64_t rows = 0, kp = 0, row_bytes = 0;
  const uint8_t* row(int64_t e, int64_t r) const { return base + (e * rows + r) * row_bytes; }
};

// The canonical rows of intermediate unit u in w13 [2I, H]: gate u and up I + u, or for
// swigluoai (interleaved) 2u and 2u + 1. Both schedules read the biases by them.
inline int64_t gate_row(int64_t act, int64_t u) { return act == kSwigluOai ? 2 * u : u; }
inline int64_t up_row(int64_t act, int64_t inter, int64_t u) { return act == kSwigluOai ? 2 * u + 1 : inter + u; }

// A bf16-weight input element: with AVX512-BF16, bf16 bits in their natural order (vdpbf16ps
// multiplies bf16 pairs into fp32 sums); on AVX2, fp32, interleaved per kLanes values (evens,
// then odds) so that a weight vector widened by a shift and a mask meets its inputs.
#if MD_AVX512
using BfInput = uint16_t;
#else
using BfInput = float;
#endif

#if MD_AVX512
// The lanes k .. hi - 1 of 16 (a masked tail).
inline __mmask16 tail(int64_t k, int64_t hi) {
  return hi - k >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (hi - k)) - 1);
}

// 16 fp32 values to bf16 bits (in 32-bit lanes) exactly as c10::BFloat16(float) rounds them.
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
#endif

// Input vectors in the layout of the rows' dot product (bf16 weights).
struct Inputs {
  int64_t kp = 0, n = 0;
  std::vector<BfInput> f;     // [n, kp]
  // AVX512-BF16: each value's remainder v - bf16(v) in bf16, [n, kp], allocated at the first
  // value that is not exactly a bf16 (the activated intermediate; an input scaled by its
  // router weight), else empty: dotted too, it keeps those inputs at fp32's precision (about
  // 2^-17), as the fused kernels keep their intermediate. Rounding it to bf16 alone moved a
  // random Mixtral's first-step logprobs by 0.9 inside vLLM's engine (two layers amplify it);
  // bf16 x needs no remainder and gets none.
  std::vector<BfInput> lo;
  void init(int64_t n_, int64_t kp_) {
    n = n_, kp = kp_;
    f.assign(n * kp, BfInput{0});
    lo.clear();
  }
  // Vector i's remainder (null where there is none: AVX2, or every value a bf16).
  const BfInput* rest(int64_t i) const { return lo.empty() ? nullptr : lo.data() + i * kp; }
  // Fill vector i from len fp32 values (the rest of kp stays zero).
  void set(int64_t i, const float* v, int64_t len) {
    BfInput* out = f.data() + i * kp;
#if MD_AVX512
    // v = hi + lo, each rounded as c10::BFloat16 rounds (to nearest even on the bits, a NaN
    // as 0x7FC0), 16 values at a time. Why vectorised: one value at a time step 3 took 2 ns
    // per value on its one thread: at C1 (E=8 top-2 H=1024 I=1408) T=8, 46 us of a 1.4 ms
    // call, 12 us vectorised (a Zen 5). Why not vcvtneps2bf16: it takes a subnormal as zero,
    // where c10 rounds the largest ones up to the smallest normal bf16, which vdpbf16ps does
    // not flush; and a subnormal that is a bf16 would get a remainder, and its vectors the
    // second dot product (tests/test_native_extension.py).
    for (int64_t k = 0; k < len; k += 16) {
      const __mmask16 mk = tail(k, len);
      const __m512 x = _mm512_maskz_loadu_ps(mk, v + k);
      const __m512i hi = bf16_bits(x);
      // An infinity is a bf16 with no remainder (inf - inf would make it NaN, where the avx2
      // build and float math keep the infinity).
      const __mmask16 inf = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
      const __m512 r = _mm512_maskz_sub_ps(static_cast<__mmask16>(~inf), x,
                                           _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
      _mm256_mask_storeu_epi16(out + k, mk, _mm512_cvtepi32_epi16(hi));
      // A zero remainder is the vector's zero fill (NaN is not zero: unordered).
      const __mmask16 nz = _mm512_mask_cmp_ps_mask(mk, r, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      if (!nz) continue;
      if (lo.empty()) lo.assign(n * kp, BfInput{0});
      _mm256_mask_storeu_epi16(lo.data() + i * kp + k, nz, _mm512_cvtepi32_epi16(bf16_bits(r)));
    }
#else
    // Within each block of kLanes (16) values: the 8 evens, then the 8 odds; whole blocks
    // 16 values at a time (as the avx512 build, for step 3's one thread), the tail by value.
    const int64_t whole = len - len % kLanes;
    for (int64_t k = 0; k < whole; k += kLanes) {
      const __m256 a = _mm256_loadu_ps(v + k), b = _mm256_loadu_ps(v + k + 8);
      // per 128-bit half: a's two evens (odds), then b's; the middle quarters swapped after
      const __m256 ev = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
      const __m256 od = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      _mm256_storeu_ps(out + k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
      _mm256_storeu_ps(out + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
    }
    for (int64_t k = whole; k < len; ++k) {
      const int64_t j = k - whole;
      out[whole + (j % 2) * (kLanes / 2) + j / 2] = v[k];
    }
#endif
  }
};

// One projection [experts, rows, Kp] in the kernel's layout (_pack.py's tensors, checked).
inline Proj make_proj(int64_t experts, int64_t rows, at::Tensor q) {
  Proj p;
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(0) == experts && q.size(1) == rows,
              "weights [E, N, Kp] contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "bf16 weights in rows");
  p.kp = q.size(2);
  TORCH_CHECK(p.kp % kBlock == 0, "the reduction axis is padded to a multiple of 32");
  p.row_bytes = q.element_size() * p.kp;
  p.q = std::move(q);
  p.base = static_cast<const uint8_t*>(p.q.const_data_ptr());
  p.rows = rows;
  return p;
}

// Software prefetch this far ahead of each row's stream: with two rows at once (two
// streams, one shared input) it lifts 2-core streaming on a Zen 1 from 16 to 22 GB/s
// (measured in a standalone loop; the plain read loop reached 20).
constexpr int64_t kAhead = 2048;

inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kAhead, _MM_HINT_T0);
}

}  // namespace moe_dispatch_native
