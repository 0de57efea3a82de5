// The native kernel's building blocks (included by kernel.cpp only): the two-row dot
// products of bf16 rows (dots_bf16.h, on layout.h), the blocks of 16 rows for int8 and int4
// (blocks_quant.h) and the activations (activations.h).
// kernel.py names every header in the build, so that an edit rebuilds.

#pragma once

#include "dots_bf16.h"
#include "blocks_quant.h"
#include "activations.h"

namespace moe_dispatch_native {

// Rows r0 and r1 of bf16 weights dotted with the n inputs idx[], into
// o = {r0.x0, r1.x0, r0.x1, r1.x1, ...}, two inputs at a time: each weight block is loaded and
// widened once for both. Each input's sums are its own, so a token's result never depends on
// the tokens beside it.
inline void rows_dots(const Proj& p, int64_t e, int64_t r0, int64_t r1, const Inputs& in,
                      const int64_t* idx, int64_t n, float* o) {
  const auto* w0 = reinterpret_cast<const uint16_t*>(p.row(e, r0));
  const auto* w1 = reinterpret_cast<const uint16_t*>(p.row(e, r1));
  for (int64_t q = 0; q < n; q += 2) {
    const int64_t i0 = idx[q];
    if (q + 1 < n) {
      const int64_t i1 = idx[q + 1];
      dot2x2_bf16(w0, w1, in.f.data() + i0 * p.kp, in.f.data() + i1 * p.kp, in.rest(i0),
                  in.rest(i1), p.kp, o + 2 * q);
    } else {
      dot2_bf16(w0, w1, in.f.data() + i0 * p.kp, in.rest(i0), p.kp, o + 2 * q);
    }
  }
}

}  // namespace moe_dispatch_native
