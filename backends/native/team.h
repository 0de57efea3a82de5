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
#include <memory>
#include <tuple>
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

// A step's work items [0, n), first split as Team::share splits them (one contiguous range
// per thread, one stream for the prefetcher); each thread takes its own range from the
// front, a chunk of items at a time, then chunks from the back of the range with the most
// left. Why: items do not cost the same (at T=2-8 an expert with two tokens costs more
// arithmetic per byte than one with one: int4 at two tokens per expert is compute-bound on
// AVX2), and a VM's vCPU can lag; with fixed ranges the other thread then waits at the
// barrier. Measured on a Zen 3 (cold, 2 threads): at T=1 the faster thread waited at the
// barriers after steps 2 and 4 for 6-10% of a call on average, two thirds of it after step 2,
// which this takes (step 4's columns all cost the same). Step 2 this way, against fixed
// ranges (the forced native layer, paired rounds, four runs): 0.90-0.98x of the time at E=8
// top-2 H=1024 I=1408 T=4-8 in bf16, int8 and int4 g128; at T=1 and at E=64 top-8 H=2048
// I=768 0.90-1.04x (the spread of this VM's runs).
class Shares {
 public:
  // Weight bytes per chunk a thread takes at a time, or one item where an item holds more:
  // one to four items of 16 units at the benchmarks' shapes (chunks of two and of four int8 /
  // int4 items measured alike on a Zen 3; each chunk costs one compare-and-swap).
  static constexpr int64_t kChunkBytes = 64 * 1024;

  // By one thread of the team, before the barrier that precedes the step: n items of
  // item_bytes of weights each.
  void init(const Team& team, int64_t n, int64_t item_bytes) {
    TORCH_CHECK(n < (int64_t{1} << 32), "work items: fewer than 2**32");
    chunk_ = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, item_bytes));
    size_ = team.size;
    ranges_.reset(new Range[size_]);
    for (int t = 0; t < size_; ++t) {
      Team other = team;
      other.id = t;
      const auto [lo, hi] = other.share(n);
      ranges_[t].v.store(pack(lo, hi), std::memory_order_relaxed);
    }
  }

  // item(i) for every item this thread takes; the items of a thread's chunk in order. A range
  // with one chunk left is left to its owner (checked again in take, which the owner may race):
  // a taken chunk starts a new stream, cold.
  template <class Item>
  void run(const Team& team, Item&& item) const {
    for (auto [lo, hi] = take(team.id, true); lo < hi; std::tie(lo, hi) = take(team.id, true))
      for (int64_t i = lo; i < hi; ++i) item(i);
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int t = 0; t < size_; ++t) {
        const int64_t left = remaining(ranges_[t].v.load(std::memory_order_relaxed));
        if (t != team.id && left > std::max(most, chunk_)) most = left, victim = t;
      }
      if (victim < 0) return;
      const auto [lo, hi] = take(victim, false);
      for (int64_t i = lo; i < hi; ++i) item(i);
    }
  }

 private:
  struct alignas(64) Range {  // [lo, hi) packed in one word: one compare-and-swap per chunk
    std::atomic<uint64_t> v{0};
  };
  static uint64_t pack(int64_t lo, int64_t hi) {
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
  }
  static int64_t remaining(uint64_t v) {
    return static_cast<int64_t>(v >> 32) - static_cast<int64_t>(v & 0xFFFFFFFFu);
  }
  // A chunk from the front or the back of thread t's range ([0, 0) when it is empty).
  std::pair<int64_t, int64_t> take(int t, bool front) const {
    uint64_t v = ranges_[t].v.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(v & 0xFFFFFFFFu), hi = static_cast<int64_t>(v >> 32);
      if (lo >= hi || (!front && hi - lo <= chunk_)) return {0, 0};  // the last chunk: its owner's
      const int64_t a = front ? lo : std::max(lo, hi - chunk_);
      const int64_t b = front ? std::min(hi, lo + chunk_) : hi;
      // Relaxed: the items are disjoint, and the step's barrier publishes what they wrote.
      if (ranges_[t].v.compare_exchange_weak(v, front ? pack(b, hi) : pack(lo, a),
                                             std::memory_order_relaxed))
        return {a, b};
    }
  }

  int64_t chunk_ = 1;
  int size_ = 1;
  std::unique_ptr<Range[]> ranges_;
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
