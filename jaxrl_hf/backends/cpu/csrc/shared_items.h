// The thread sharing of every kernel in this folder: the items of one call, claimed one at a time from an atomic
// counter by the calling thread and by tasks scheduled on XLA's intra-op thread pool. The caller waits only for
// items another thread has claimed, so it never waits on a task that has not started (no deadlock when every
// pool thread is busy), and a task that starts after the work is gone returns at once (the shared state outlives
// the call).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxrl_hf {

// Items [0, items) of one call; Work::Item(i) does item i (CRTP: struct Work : SharedItems<Work>).
template <typename Work>
struct SharedItems {
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      static_cast<Work*>(this)->Item(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// How many pool tasks help the calling thread with `items` items.
inline int64_t Helpers(xla::ffi::ThreadPool& pool, int64_t items) {
  return std::max<int64_t>(std::min<int64_t>(pool.num_threads(), items) - 1, 0);
}

// Every item of `work` done by the calling thread and `helpers` pool tasks.
template <typename Work>
void RunShared(xla::ffi::ThreadPool& pool, const std::shared_ptr<Work>& work, int64_t helpers) {
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->items) _mm_pause();
}

}  // namespace jaxrl_hf
