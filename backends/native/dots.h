// The native kernel's building blocks (included by kernel.cpp only): the ISA of this
// build, the weight and input layouts, the two-row dot products, the activations.
// kernel.py names it in the build's headers (NativeExtension), so that an edit here rebuilds.

#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define MD_AVX512 1
constexpr const char* kIsa = "avx512";
constexpr int64_t kLanes = 32;  // bf16 values per 512-bit load: the input interleave width
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One projection in the kernel's layout; raw pointers resolved once (a Tensor accessor per
// row costs more than the row's arithmetic: measured 8 ms per C2 call with them).
struct Proj {
  at::Tensor q, scales, zeros;  // held for their storage; zeros undefined: the offset applies
  const uint8_t* base = nullptr;
  const float* s32 = nullptr;
  const uint16_t* s16 = nullptr;
  const uint8_t* z = nullptr;
  int64_t rows = 0, kp = 0, row_bytes = 0, groups = 1, bpg = 1, offset = 0;
  bool paired = false;  // int4 dotted two blocks at a time (dot_int4_pairs); inputs to match
  const uint8_t* row(int64_t e, int64_t r) const { return base + (e * rows + r) * row_bytes; }
};

// An input vector in the layout of the weights' dot product: fp32 interleaved (bf16), or
// int8 blocks with their scales, and each block's scale times its sum of values (the int4
// zero-point correction of a group is its weight scale x zero x the sum of these).
struct Inputs {
  int64_t kp = 0, n = 0;
  bool quantized = false, paired = false;
  std::vector<float> f;       // [n, kp]
  std::vector<int8_t> q;      // [n, kp]
  std::vector<float> d;       // [n, kp/32]
  std::vector<float> sd;      // [n, kp/32]
  std::vector<float> d4;      // paired: [n, kp/32, 4], each block's scale four times
  void init(int64_t n_, int64_t kp_, bool quantized_, bool paired_ = false) {
    n = n_, kp = kp_, quantized = quantized_, paired = quantized_ && paired_;
    if (quantized) {
      q.assign(n * kp, 0);
      d.assign(n * (kp / kBlock), 0.f);
      sd.assign(n * (kp / kBlock), 0.f);
      if (paired) d4.assign(n * (kp / kBlock) * 4, 0.f);
    } else {
      f.assign(n * kp, 0.f);
    }
  }
  // Fill vector i from len fp32 values (the rest of kp stays zero).
  void set(int64_t i, const float* v, int64_t len) {
    if (!quantized) {
      float* out = f.data() + i * kp;
      for (int64_t k = 0; k < len; ++k) {  // within each kLanes block: evens, then odds
        const int64_t base = k - k % kLanes, j = k % kLanes;
        out[base + (j % 2) * (kLanes / 2) + j / 2] = v[k];
      }
      return;
    }
    const int64_t nb = kp / kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(len, lo + kBlock);
      float amax = 0.f;
      for (int64_t k = lo; k < hi; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t s = 0;
      int8_t* out = q.data() + i * kp + lo;
      for (int64_t k = lo; k < hi; ++k) {
        const int32_t r = static_cast<int32_t>(std::nearbyint(v[k] * inv));
        out[k - lo] = static_cast<int8_t>(r);
        s += r;
      }
      d[i * nb + b] = scale;
      sd[i * nb + b] = scale * static_cast<float>(s);
      if (paired) std::fill_n(d4.data() + (i * nb + b) * 4, 4, scale);
    }
    if (!paired) return;
    // Each pair of blocks (A, B) as the int4 pair dot reads it: A 0..15, B 0..15, A 16..31,
    // B 16..31 (an odd last block stays as it is).
    int8_t tmp[2 * kBlock];
    for (int64_t b = 0; b + 1 < nb; b += 2) {
      int8_t* blk = q.data() + i * kp + b * kBlock;
      for (int64_t j = 0; j < 16; ++j) {
        tmp[j] = blk[j], tmp[16 + j] = blk[kBlock + j];
        tmp[32 + j] = blk[16 + j], tmp[48 + j] = blk[kBlock + 16 + j];
      }
      std::copy(tmp, tmp + 2 * kBlock, blk);
    }
  }
};

// Software prefetch this far ahead of each row's stream: with two rows at once (two
// streams, one shared input) it lifts 2-core streaming on a Zen 1 from 16 to 22 GB/s
// (measured in a standalone loop; the plain read loop reached 20).
constexpr int64_t kAhead = 2048;

inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kAhead, _MM_HINT_T0);
}

// Rows w0 and w1 dotted with one input (interleaved fp32), into o[0], o[1].
void dot2_bf16(const uint16_t* w0, const uint16_t* w1, const float* x, int64_t kp, float* o) {
#if MD_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < kp; k += 32) {
    prefetch(w0 + k);
    prefetch(w1 + k);
    const __m512 xe = _mm512_loadu_ps(x + k), xo = _mm512_loadu_ps(x + k + 16);
    const __m512i v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
    a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), xe, a0);
    a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v0, mask)), xo, a1);
    b0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), xe, b0);
    b1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v1, mask)), xo, b1);
  }
  o[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  o[1] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
#else
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
#endif
}

// Rows w0 and w1 dotted with two inputs x0 and x1 (interleaved fp32), into
// o = {w0.x0, w1.x0, w0.x1, w1.x1}: each weight vector is widened once for both inputs
// (an expert's second routed token costs FMAs, not a second widening and load). Every sum
// runs in dot2_bf16's exact order, so a token's result does not depend on its neighbour.
void dot2x2_bf16(const uint16_t* w0, const uint16_t* w1, const float* x0, const float* x1,
                 int64_t kp, float* o) {
#if MD_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), d0 = _mm512_setzero_ps(), d1 = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < kp; k += 32) {
    prefetch(w0 + k);
    prefetch(w1 + k);
    const __m512i v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
    const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
    const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(v0, mask));
    const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
    const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(v1, mask));
    const __m512 xe = _mm512_loadu_ps(x0 + k), xo = _mm512_loadu_ps(x0 + k + 16);
    a0 = _mm512_fmadd_ps(w0e, xe, a0);
    a1 = _mm512_fmadd_ps(w0o, xo, a1);
    b0 = _mm512_fmadd_ps(w1e, xe, b0);
    b1 = _mm512_fmadd_ps(w1o, xo, b1);
    const __m512 ye = _mm512_loadu_ps(x1 + k), yo = _mm512_loadu_ps(x1 + k + 16);
    c0 = _mm512_fmadd_ps(w0e, ye, c0);
    c1 = _mm512_fmadd_ps(w0o, yo, c1);
    d0 = _mm512_fmadd_ps(w1e, ye, d0);
    d1 = _mm512_fmadd_ps(w1o, yo, d1);
  }
  o[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  o[1] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
  o[2] = _mm512_reduce_add_ps(_mm512_add_ps(c0, c1));
  o[3] = _mm512_reduce_add_ps(_mm512_add_ps(d0, d1));
#else
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
#endif
}

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

// dot_quant's int4 blocks [lo, hi) of one group, two at a time where two remain: one 32-byte
// load and three ops unpack two blocks of a row (one block alone takes five). Measured
// on a Zen 3 at C2 T=1: int4 was bound by this arithmetic at 45% of the DRAM read.
template <int kN>
inline void int4_group(const uint8_t* w0, const uint8_t* w1, const int8_t* const* xq,
                       const float* const* x4, const float* const* xd, int64_t lo, int64_t hi,
                       __m256* part0, __m256* part1) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  int64_t b = lo;
  for (; b + 1 < hi; b += 2) {
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
  for (; b < hi; ++b) {  // the odd last block, in the plain order
    const __m256i u0 = int4_block(w0 + b * 16), u1 = int4_block(w1 + b * 16);
    for (int n = 0; n < kN; ++n) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[n] + b * kBlock));
      const __m256 scale = _mm256_broadcast_ss(xd[n] + b);
      part0[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(u0, x)), scale, part0[n]);
      part1[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(u1, x)), scale, part1[n]);
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
    if (kFour && p.paired) {
      int4_group<kN>(w0, w1, xq, x4, xd, lo, hi, part0, part1);
      for (int n = 0; n < kN; ++n)
        for (int64_t b = lo; b < hi; ++b) xsum[n] += xs[n][b];
    }
    for (int64_t b = (kFour && p.paired) ? hi : lo; b < hi; ++b) {
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

inline void row_dot2(int64_t fmt, const Proj& p, int64_t e, int64_t r0, int64_t r1,
                     const Inputs& in, int64_t i, float* o) {
  if (fmt == kBf16)
    dot2_bf16(reinterpret_cast<const uint16_t*>(p.row(e, r0)),
              reinterpret_cast<const uint16_t*>(p.row(e, r1)), in.f.data() + i * p.kp, p.kp, o);
  else if (fmt == kInt4)
    dot_quant<true, 1>(p, e, r0, r1, in, &i, o);
  else
    dot_quant<false, 1>(p, e, r0, r1, in, &i, o);
}

// Rows r0 and r1 dotted with inputs i0 and i1, into o = {r0.i0, r1.i0, r0.i1, r1.i1}:
// each weight block is loaded and widened (or unpacked) once for both inputs.
inline void row_dot2x2(int64_t fmt, const Proj& p, int64_t e, int64_t r0, int64_t r1,
                       const Inputs& in, int64_t i0, int64_t i1, float* o) {
  if (fmt == kBf16) {
    dot2x2_bf16(reinterpret_cast<const uint16_t*>(p.row(e, r0)),
                reinterpret_cast<const uint16_t*>(p.row(e, r1)), in.f.data() + i0 * p.kp,
                in.f.data() + i1 * p.kp, p.kp, o);
    return;
  }
  const int64_t idx[2] = {i0, i1};
  if (fmt == kInt4)
    dot_quant<true, 2>(p, e, r0, r1, in, idx, o);
  else
    dot_quant<false, 2>(p, e, r0, r1, in, idx, o);
}

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
      const float g = std::min(gate, kSwigluLimit);
      const float u = std::max(-kSwigluLimit, std::min(up, kSwigluLimit));
      return (u + 1.f) * g / (1.f + std::exp(-kSwigluAlpha * g));
    }
  }
}


}  // namespace moe_dispatch_native
