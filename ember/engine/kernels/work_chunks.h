// Work shared out in chunks that torch's threads take in turn, where at::parallel_for
// gives each thread a fixed share up front. On a machine whose cores also run other
// processes (the API process, a client, a neighbour), a thread that loses its core for a
// while leaves its share undone while the others wait at the region's end; here the
// others take the chunks it has not started. A range at most `grain` long runs on the
// calling thread, as at::parallel_for runs it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// chunks a thread can take, about (fewer: a chunk's turn costs an atomic add; more: the
// last chunks leave less for the others to wait on)
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
  const int64_t threads = at::in_parallel_region() ? 1 : std::max(at::get_num_threads(), 1);
  const int64_t chunk =
      std::max<int64_t>({grain, 1, (n + kChunksPerThread * threads - 1) / (kChunksPerThread * threads)});
  const int64_t takers = std::min(threads, (n + chunk - 1) / chunk);
  if (takers <= 1) {
    begin_thread();
    fn(int64_t{0}, n);
    end_thread();
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, takers, 1, [&](int64_t, int64_t) {
    begin_thread();
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < n;)
      fn(begin, std::min(begin + chunk, n));
    end_thread();
  });
}
