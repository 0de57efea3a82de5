// The native kernel's building blocks (included by kernel.cpp only): the two-row dot
// products of bf16 and (avx2 build) int8 rows (dots_bf16.h, dots_quant.h, on layout.h), the
// blocks of 16 rows for int4 and the avx512 build's int8 (blocks_quant.h) and the
// activations (activations.h).
// kernel.py names every header in the build, so that an edit rebuilds.

#pragma once

#include "dots_bf16.h"
#include "dots_quant.h"
#include "blocks_quant.h"
#include "activations.h"

namespace moe_dispatch_native {

inline void row_dot2(int64_t fmt, const Proj& p, int64_t e, int64_t r0, int64_t r1,
                     const Inputs& in, int64_t i, float* o) {
  if (fmt == kBf16)
    dot2_bf16(reinterpret_cast<const uint16_t*>(p.row(e, r0)),
              reinterpret_cast<const uint16_t*>(p.row(e, r1)), in.f.data() + i * p.kp,
              in.rest(i), p.kp, o);
  else
    dot_int8<1>(p, e, r0, r1, in, &i, o);
}

// Rows r0 and r1 dotted with inputs i0 and i1, into o = {r0.i0, r1.i0, r0.i1, r1.i1}:
// each weight block is loaded and widened (or unpacked) once for both inputs.
inline void row_dot2x2(int64_t fmt, const Proj& p, int64_t e, int64_t r0, int64_t r1,
                       const Inputs& in, int64_t i0, int64_t i1, float* o) {
  if (fmt == kBf16) {
    dot2x2_bf16(reinterpret_cast<const uint16_t*>(p.row(e, r0)),
                reinterpret_cast<const uint16_t*>(p.row(e, r1)), in.f.data() + i0 * p.kp,
                in.f.data() + i1 * p.kp, in.rest(i0),
                in.rest(i1), p.kp, o);
    return;
  }
  const int64_t idx[2] = {i0, i1};
  dot_int8<2>(p, e, r0, r1, in, idx, o);
}

// Rows r0 and r1 dotted with the n inputs idx[], o as row_dot2x2 writes it, two at a time.
// Each input's sums are its own, so a token's result never depends on the tokens beside it.
inline void rows_dots(int64_t fmt, const Proj& p, int64_t e, int64_t r0, int64_t r1,
                      const Inputs& in, const int64_t* idx, int64_t n, float* o) {
  for (int64_t q = 0; q < n; q += 2) {
    if (q + 1 < n) row_dot2x2(fmt, p, e, r0, r1, in, idx[q], idx[q + 1], o + 2 * q);
    else row_dot2(fmt, p, e, r0, r1, in, idx[q], o + 2 * q);
  }
}

}  // namespace moe_dispatch_native
