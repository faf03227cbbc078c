#pragma once

// Ranks as threads of the test's process: each gets a World from
// gpipe::dist::init_from_store over one c10d::HashStore, so that Gloo
// groups talk over loopback without a launcher.

#include <gpipe/dist.h>

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

namespace gpipe::dist::testing {

/// Runs `fn(rank)` on `n` threads, one per rank; rethrows the first rank's
/// error after every thread has ended.
inline void run_threads(
    int64_t n, const std::function<void(int64_t rank)>& fn) {
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first) {
          first = std::current_exception();
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

/// Runs `fn` on `n` ranks, each a thread with its World; rethrows the first
/// rank's error after every thread has ended.
inline void run_ranks(int64_t n, const std::function<void(World)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_threads(n, [&](int64_t r) {
    fn(init_from_store(store, r, n, std::chrono::seconds(30)));
  });
}

}  // namespace gpipe::dist::testing
