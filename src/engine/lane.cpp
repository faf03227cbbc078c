#include "engine/lane.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <limits>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace gpipe::detail {

// Note [Lanes and glibc's malloc]
// glibc gives each thread that allocates its own arena, and an arena other
// than the main one lives in heaps of at most 64 MiB that it unmaps or
// shrinks as soon as they are free. A lane's activations (megabytes each,
// a whole partition's worth in flight) therefore went back to the system
// at the end of every step and came back as fresh pages in the next: a
// conv model through 2 lanes at chunks 1 took 27,000 minor page faults and
// 2 to 3 times the plain model's time per step (gpipe-bench --only conv).
// One arena that keeps what is freed (no mmap for big blocks, no trimming)
// reuses the same memory every step, as the plain model on the main thread
// mostly does: about 1,200 faults, and the plain model's time. It takes
// hold for threads that get their arena after it: with one arena allowed,
// glibc hands them the arenas that exist, in turn, and a thread that
// allocated before it keeps an arena of its own that a lane may then be
// handed. gpipe::dist::init_from_env therefore calls this before c10d
// starts its threads: after them, each rank had 3 or 4 arenas, and in one
// run out of two a rank's U-Net steps took 8,000 to 30,000 fresh pages
// each. A program that starts threads of its own first can set it from the
// start with the GLIBC_TUNABLES that docs/guide.md gives. It applies to the
// whole process and only to memory freed from then on; peak memory is not
// given back to the system until the process ends. The user's own settings win:
// with GPIPE_MALLOC=system, MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES in the environment, malloc is
// left alone (as it is under another allocator, such as jemalloc).
void keep_freed_memory_once() {
#if defined(__GLIBC__) && defined(M_ARENA_MAX)
  static const bool done = [] {
    const char* choice = std::getenv("GPIPE_MALLOC");
    if (choice != nullptr && std::string(choice) == "system") {
      return false;
    }
    for (const char* name :
         {"MALLOC_ARENA_MAX",
          "MALLOC_MMAP_THRESHOLD_",
          "MALLOC_TRIM_THRESHOLD_",
          "MALLOC_MMAP_MAX_",
          "GLIBC_TUNABLES"}) {
      if (std::getenv(name) != nullptr) {
        return false;
      }
    }
    mallopt(M_ARENA_MAX, 1);
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
    return true;
  }();
  (void)done;
#endif
}

Lane::Lane(std::function<void()> init)
    // Before the first lane thread allocates (Note [Lanes and glibc's
    // malloc]).
    : thread_(
          (keep_freed_memory_once(),
           std::thread([this, init = std::move(init)]() mutable {
             loop(std::move(init));
           }))) {}

Lane::~Lane() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Lane::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void Lane::loop(std::function<void()> init) {
  if (init) {
    init();
  }
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      // Leave only once the queue is empty: a waiting caller counts on every
      // posted task running.
      if (queue_.empty()) {
        return;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

bool FirstError::set(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) {
    return false;
  }
  error_ = std::move(error);
  return true;
}

bool FirstError::has() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(error_);
}

void FirstError::rethrow_and_clear() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, error_);
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

std::exception_ptr with_context(
    std::exception_ptr error, const std::string& where) {
  try {
    std::rethrow_exception(error);
  } catch (c10::Error& e) {
    // c10::Error puts a lone context in parentheses itself.
    e.add_context("in gpipe " + where);
    return std::current_exception();
  } catch (const std::exception& e) {
    try {
      TORCH_CHECK(false, e.what(), " (in gpipe ", where, ")");
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    try {
      TORCH_CHECK(false, "unknown exception (in gpipe ", where, ")");
    } catch (...) {
      return std::current_exception();
    }
  }
  return error;
}

}  // namespace gpipe::detail
