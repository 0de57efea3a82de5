// One OpenMP team for all the steps of a call, with a barrier between steps, where
// at::parallel_for opens a parallel region per step (wake the threads, split, join: four
// per call). Measured on a Zen 4 (2 threads, cold caches, the kernel's forward called
// directly, this build against the per-step regions' build in one process, E=8 top-2
// H=1024 I=1408 and E=64 top-8 H=2048 I=768, T=1-16): int8 / int4 0.91-1.03x of the time
// (median 0.97x), bf16 0.97-1.04x (no change beyond the noise).

#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <utility>

namespace moe_dispatch_native {

struct Team {
  int id = 0, size = 1;
  std::exception_ptr* error = nullptr;  // the team's first exception, rethrown after it
  std::atomic<bool>* failed = nullptr;    // set with it: the steps after it are skipped
  // This thread's contiguous share of [0, n): the split at::parallel_for makes (n / size
  // rounded up per thread), so that each thread streams one range of the weights.
  std::pair<int64_t, int64_t> share(int64_t n) const {
    const int64_t chunk = (n + size - 1) / size, lo = std::min(n, id * chunk);
    return {lo, std::min(n, lo + chunk)};
  }
  // One step on every thread, then a barrier. An exception cannot leave an OpenMP region,
  // and a thread that skipped the barrier would leave the others waiting: it is kept (the
  // first one), the thread goes on to the barrier, and no thread runs a later step's body
  // (which would read what the failed step left half done).
  template <class Step>
  void step(Step&& body) const {
    if (!failed->load(std::memory_order_relaxed)) {
      try {
        body();
      } catch (...) {
#pragma omp critical(moe_dispatch_team_error)
        {
          if (!*error) *error = std::current_exception();
        }
        failed->store(true, std::memory_order_relaxed);
      }
    }
    if (size > 1) {
#pragma omp barrier
    }
  }
};

// body(team) on at::get_num_threads() threads (on this one alone inside another parallel
// region, as at::parallel_for does); the first exception of any step is rethrown here.
template <class Body>
void in_team(Body&& body) {
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  const int threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region() || omp_in_parallel()) {
    body(Team{0, 1, &error, &failed});
  } else {
#pragma omp parallel num_threads(threads)
    body(Team{omp_get_thread_num(), omp_get_num_threads(), &error, &failed});
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace moe_dispatch_native
