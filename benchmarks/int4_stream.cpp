// One core's ceilings for the native kernel's int4 inner loop (backends/native/dots_quant.h,
// int4_blocks with one input and groups of 128), in a standalone copy of it: from L1 (the
// same 8 rows over and over: its arithmetic alone), and from DRAM (200 MB of rows streamed
// pairwise with the kernel's prefetch, in huge pages where the OS gives them), beside a
// plain read loop with the same prefetch (the core's streaming ceiling).
//
//   g++ -O3 -mavx2 -mfma -mf16c benchmarks/int4_stream.cpp -o /tmp/int4_stream && /tmp/int4_stream
//
// Weight bytes per second, one thread, medians of 5 runs each.

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kHidden = 2048, kBlocks = kHidden / 32, kRowBytes = kHidden / 2, kAhead = 2048;
constexpr size_t kRows = 200000;  // 200 MB of int4 rows: far beyond the last-level cache

__attribute__((noinline)) float int4_rows(const uint8_t* w0, const uint8_t* w1, const int8_t* x,
                                          const float* d4, const float* scales) {
  const __m256i m = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, ws0 = acc0, ws1 = acc0;
  for (int b = 0, g = 0; b + 1 < kBlocks; b += 2) {
    if ((b & 3) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w0) + b * 16 + kAhead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1) + b * 16 + kAhead, _MM_HINT_T0);
      ws0 = _mm256_set1_ps(scales[g]), ws1 = _mm256_set1_ps(scales[g + 1]), g += 2;
    }
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * 16));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * 16));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * 32));
    const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * 32 + 32));
    const __m256 xs = _mm256_loadu_ps(d4 + b * 4);
    auto dot = [&](__m256i v) {
      const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
      return _mm256_cvtepi32_ps(_mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo, x1), _mm256_maddubs_epi16(hi, x2)), ones));
    };
    acc0 = _mm256_fmadd_ps(dot(v0), _mm256_mul_ps(xs, ws0), acc0);
    acc1 = _mm256_fmadd_ps(dot(v1), _mm256_mul_ps(xs, ws1), acc1);
  }
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(acc0, acc1));
  return o[0] + o[7];
}

__attribute__((noinline)) float plain_rows(const uint8_t* w0, const uint8_t* w1, const int8_t*,
                                           const float*, const float*) {
  __m256i acc = _mm256_setzero_si256();
  for (int b = 0; b + 1 < kBlocks; b += 2) {
    if ((b & 3) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w0) + b * 16 + kAhead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1) + b * 16 + kAhead, _MM_HINT_T0);
    }
    acc = _mm256_or_si256(acc, _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * 16)),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * 16))));
  }
  return static_cast<float>(_mm256_extract_epi32(acc, 0));
}

}  // namespace

int main() {
  const size_t bytes = kRows * kRowBytes;
  auto* w = static_cast<uint8_t*>(aligned_alloc(1 << 21, bytes));
  madvise(w, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes; ++i) w[i] = static_cast<uint8_t>(rand());
  std::vector<int8_t> x(kHidden);
  for (auto& v : x) v = static_cast<int8_t>(rand() % 255 - 127);
  std::vector<float> d4(kBlocks * 4, 0.01f), scales(kBlocks, 0.02f);
  float sink = 0.f;
  using Fn = float (*)(const uint8_t*, const uint8_t*, const int8_t*, const float*, const float*);
  auto rate = [&](Fn fn, bool from_l1) {
    std::vector<double> runs;
    for (int run = 0; run < 5; ++run) {
      const auto t0 = std::chrono::steady_clock::now();
      size_t read = 0;
      for (size_t r = 0; r + 1 < kRows; r += 2, read += 2 * kRowBytes) {
        const uint8_t* p = w + (from_l1 ? (r / 2 % 8) * 2 : r) * kRowBytes;
        sink += fn(p, p + kRowBytes, x.data(), d4.data(), scales.data());
      }
      runs.push_back(read / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
    }
    std::sort(runs.begin(), runs.end());
    return runs[2];
  };
  std::printf("int4 loop, rows from L1:   %5.1f GB/s\n", rate(int4_rows, true));
  std::printf("int4 loop, rows from DRAM: %5.1f GB/s\n", rate(int4_rows, false));
  std::printf("plain read loop, DRAM:     %5.1f GB/s\n", rate(plain_rows, false));
  std::printf("(checksum %g)\n", sink);
  return 0;
}
