#pragma once

// Counting the CPU memory that a thread allocates and keeps alive, for
// profile_sizes. See Note [Counting CPU allocations] in allocator.cpp.

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

namespace gpipe::detail {

/// Bytes counted and not yet freed; shared with the allocations it counts,
/// which may be freed after the window that counted them has closed.
using LiveBytes = std::shared_ptr<std::atomic<int64_t>>;

// Installs the counting allocator for its lifetime; one at a time in the
// process.
class CountingAllocatorScope {
 public:
  CountingAllocatorScope();
  ~CountingAllocatorScope();
  CountingAllocatorScope(const CountingAllocatorScope&) = delete;
  CountingAllocatorScope& operator=(const CountingAllocatorScope&) = delete;

 private:
  static std::mutex& mutex();
  std::unique_lock<std::mutex> lock_;
  c10::Allocator* previous_ = nullptr;
  uint8_t priority_ = 0;
};

// Counts the bytes that this thread allocates during its lifetime and that
// are still alive.
class CountingWindow {
 public:
  CountingWindow();
  ~CountingWindow();
  CountingWindow(const CountingWindow&) = delete;
  CountingWindow& operator=(const CountingWindow&) = delete;

  int64_t bytes() const {
    return live_->load();
  }

 private:
  LiveBytes live_;
  LiveBytes* previous_;
};

}  // namespace gpipe::detail
