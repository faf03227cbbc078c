#pragma once

// Lanes: one thread and one task queue per partition (after MLX's
// StreamThread). A lane runs its tasks one after the other in the order they
// were posted; the pipeline posts a partition's cells in schedule order.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
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
  /// A thread that cannot start (a limit on processes or threads) is a
  /// c10::Error saying so, not std::system_error.
  explicit Lane(std::function<void()> init = {});
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  /// Runs every task still queued, then joins the thread. In a child made
  /// by fork() after the lane started, lets it go without a word: see
  /// Note [Lanes across fork()].
  ~Lane();

  /// Queues `task` behind the ones already posted.
  void post(std::function<void()> task);

  /// The lane's thread id (tests check that lanes are distinct threads).
  std::thread::id thread_id() const {
    return state_->thread.get_id();
  }

  /// True in a child made by fork() after the lane started: its thread
  /// was the parent's and does not run here.
  bool forked() const;

 private:
  // What the thread shares with its owner: on the heap, so that a forked
  // child can leave it untouched (its condition variable may list the
  // parent's thread as a waiter, and destroying it would wait forever).
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;  // guarded by mutex
    bool stop = false;                        // guarded by mutex
    std::thread thread;
  };
  static void loop(State& state, std::function<void()> init);

  std::unique_ptr<State> state_;
  int64_t process_;  // getpid() where the thread started
};

/// getpid(): a Pipeline built in a parent is refused in a forked child.
int64_t current_process();

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
