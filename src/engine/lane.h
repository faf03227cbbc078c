#pragma once

// Lanes: one thread and one task queue per partition (after MLX's
// StreamThread). A lane runs its tasks one after the other in the order they
// were posted; the pipeline posts a partition's cells in schedule order.

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace gpipe::detail {

/// Sets glibc's malloc up to keep what the lanes free, once per process,
/// unless the environment chose otherwise (Note [Lanes and glibc's malloc]
/// in lane.cpp). The first Lane calls it, and gpipe::dist::init_from_env.
/// A GPIPE_MALLOC other than unset or "system" is a c10::ValueError.
void keep_freed_memory_once();

/// One worker thread with a FIFO queue. Tasks must not throw (the pipeline
/// catches inside each task and records the error in a `FirstError`).
class Lane {
 public:
  /// Starts the thread; `init` runs on it first (thread count, device).
  explicit Lane(std::function<void()> init = {});
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  /// Runs every task still queued, then joins the thread.
  ~Lane();

  /// Queues `task` behind the ones already posted.
  void post(std::function<void()> task);

  /// The lane's thread id (tests check that lanes are distinct threads).
  std::thread::id thread_id() const {
    return thread_.get_id();
  }

 private:
  void loop(std::function<void()> init);

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mutex_
  bool stop_ = false;                        // guarded by mutex_
  std::thread thread_;
};

/// Keeps the first exception of many threads; later ones are dropped.
class FirstError {
 public:
  /// Records `error` unless one is recorded already. Returns true if it was.
  bool set(std::exception_ptr error);
  bool has() const;
  /// Rethrows the recorded exception, if any, and clears it.
  void rethrow_and_clear();

 private:
  mutable std::mutex mutex_;
  std::exception_ptr error_;  // guarded by mutex_
};

/// The exception in flight with `where` ("partition 1, micro-batch 3,
/// forward") added to its message. A c10::Error keeps its type (ValueError
/// stays ValueError); anything else becomes a c10::Error with the original
/// message.
std::exception_ptr with_context(
    std::exception_ptr error, const std::string& where);

}  // namespace gpipe::detail
