// Work shared out so that a thread that loses its core for a while does not hold the
// others up. at::parallel_for gives each thread a fixed share up front: on a machine
// whose cores also run other processes (the API process, a client, a neighbour), a
// thread kept off its core leaves its share undone while the others wait at the
// region's end. Here each thread still owns the share at::parallel_for would give it and
// works through it in order, a chunk at a time (a decode step's weights streamed from
// memory in one run per thread, as before), and a thread done with its own takes the
// chunks left in the others'. A range at most `grain` long runs on the calling thread,
// as at::parallel_for runs it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

// chunks in a thread's share, about (fewer: less left to take from a thread kept off its
// core; more: a turn costs an atomic add, and a taken chunk breaks the owner's run)
constexpr int64_t kChunksPerThread = 8;

struct NoThreadHook {
  void operator()() const {}
};

// fn(begin, end) over [0, n) in chunks of at least `grain` items, each item once;
// begin_thread() / end_thread() on each thread that takes part, before its first chunk
// and after its last
template <typename Fn, typename Begin = NoThreadHook, typename End = NoThreadHook>
void parallel_chunks(int64_t n, int64_t grain, const Fn& fn, const Begin& begin_thread = {},
                     const End& end_thread = {}) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = at::in_parallel_region() ? 1 : std::max(at::get_num_threads(), 1);
  const int64_t shares = std::min(threads, (n + grain - 1) / grain);
  if (shares <= 1) {
    begin_thread();
    fn(int64_t{0}, n);
    end_thread();
    return;
  }
  const int64_t share = (n + shares - 1) / shares;
  const int64_t chunk = std::max(grain, (share + kChunksPerThread - 1) / kChunksPerThread);
  struct alignas(64) Share {  // a cache line each: the owner's adds do not slow the others'
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Share[]> owned(new Share[shares]);
  for (int64_t s = 0; s < shares; ++s) {
    owned[s].next.store(std::min(s * share, n), std::memory_order_relaxed);
    owned[s].end = std::min((s + 1) * share, n);
  }
  at::parallel_for(0, shares, 1, [&](int64_t first, int64_t) {
    begin_thread();
    for (int64_t k = 0; k < shares; ++k) {  // its own share first, then the others'
      Share& s = owned[(first + k) % shares];
      if (k > 0 && s.next.load(std::memory_order_relaxed) >= s.end) continue;  // no write
      for (int64_t begin; (begin = s.next.fetch_add(chunk, std::memory_order_relaxed)) < s.end;)
        fn(begin, std::min(begin + chunk, s.end));
    }
    end_thread();
  });
}
