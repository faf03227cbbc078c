#pragma once

// Wide cells: the long cells a plan runs alone, computed on the calling
// thread with every core while their lanes wait (Note [Wide cells on the
// calling thread] in wide_cells.cpp), and the lane times that choose them.

#include <gpipe/schedule.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <utility>

namespace gpipe::detail {

class Pipeline;

/// Counts the lanes that have not finished their row of a pass, and runs on
/// the calling thread, while it waits for them, the computes they hand it.
class Countdown {
 public:
  explicit Countdown(int64_t lanes) : count_(lanes) {}
  /// From a lane: its row is done.
  void done();
  /// From a lane: runs `task` on the waiting caller, and returns once it
  /// has (rethrowing here what it threw there).
  void run_on_caller(const std::function<void()>& task);
  /// On the caller: until every lane is done, runs the tasks they hand over.
  void wait();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t count_;  // guarded by mutex_
  // guarded by mutex_
  std::deque<std::pair<const std::function<void()>*, bool*>> tasks_;
};

/// For its lifetime, a cell's compute on this thread stands for its
/// stage's lane time times `scale`: 1 on the cell's own lane, every core
/// over the lane's count for a wide cell on the calling thread. Elsewhere
/// (0, as in a serial plan) a cell leaves the lane time as it was.
class LaneTimeScale {
 public:
  explicit LaneTimeScale(double scale);
  ~LaneTimeScale();
  LaneTimeScale(const LaneTimeScale&) = delete;
  LaneTimeScale& operator=(const LaneTimeScale&) = delete;

 private:
  double previous_;
};

/// Measures a cell's compute, without its waits for messages, and keeps it
/// as partition j's lane time in `phase` where a LaneTimeScale says so
/// (elsewhere it reads no clock).
class LaneTime {
 public:
  LaneTime(Pipeline& pipeline, int64_t j, Phase phase);
  /// Called once the compute has ended without error.
  void keep();

 private:
  Pipeline& pipeline_;
  int64_t j_;
  Phase phase_;
  double scale_;  // the LaneTimeScale at the start
  std::chrono::steady_clock::time_point start_;
};

}  // namespace gpipe::detail
