#include "engine/wide_cells.h"

#include <exception>
#include <utility>

#include "engine/cell.h"
#include "engine/pipeline.h"

namespace gpipe::detail {

// Note [Wide cells on the calling thread]
// In a plan whose lanes overlap, each CPU lane computes with its own share
// of the cores, and a cell the plan runs alone (the fill and the drain of
// fill-drain and 1F1B, a V's turn) leaves the other lanes' cores idle: on 2
// lanes at chunks 4, a quarter of the step. Such a cell, when its stage's
// last cell of the same kind took at least kWideCellSeconds on its lane, is
// computed on the calling thread, which waits for the lanes anyway, with
// every core, while its lane waits for it. The lane takes the cell's
// messages first and sends its results after: two alone cells on two lanes,
// one waiting for the other's output (zero-bubble's first forwards), would
// otherwise meet on the caller in either order, and the caller would wait in
// a receive for a cell queued behind it. The calling thread's OpenMP pool is
// the one that holds every core already (Note [Threads that follow the plan]
// in lane_threads.cpp: a lane that grew a pool of its own would make GNU
// OpenMP's barriers sleep in the kernel). Why only long cells: after a
// parallel region GNU OpenMP's workers spin for a while before they sleep,
// on a core the lanes want back, and handing a cell over wakes two threads;
// a short cell loses more to both than every core wins it, a long one wins
// (docs/benchmark-history.md, "Wide cells on the calling thread"). A stage's
// lane time is what its last cell of that kind computed on its lane, without
// the waits for its inputs; a cell run wide counts its time times every
// core over the lane's count (so that a stage whose every cell of a kind
// runs wide, zero-bubble's forwards at chunks 1, still follows its cells'
// cost); cells of a serial plan leave it as it was.

void Countdown::done() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--count_ == 0) {
    cv_.notify_all();
  }
}

void Countdown::run_on_caller(const std::function<void()>& task) {
  std::exception_ptr error;
  bool recomputing = false;
  const std::function<void()> caught = [&] {
    try {
      task();
    } catch (...) {
      error = std::current_exception();
      // Where it failed, as the calling thread noted it: the lane names it.
      recomputing = std::exchange(failed_in_recomputation(), false);
    }
  };
  bool finished = false;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    tasks_.push_back({&caught, &finished});
    cv_.notify_all();
    cv_.wait(lock, [&] { return finished; });
  }
  if (error) {
    failed_in_recomputation() = recomputing;
    std::rethrow_exception(error);
  }
}

void Countdown::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    cv_.wait(lock, [this] { return count_ == 0 || !tasks_.empty(); });
    if (tasks_.empty()) {
      return;
    }
    const auto [task, finished] = tasks_.front();
    tasks_.pop_front();
    lock.unlock();
    (*task)();  // caught: run_on_caller rethrows on the lane
    lock.lock();
    *finished = true;
    cv_.notify_all();
  }
}

namespace {

// What this thread's cells count of their compute as their lane time (see
// LaneTimeScale); 0: nothing.
thread_local double lane_time_scale = 0.0;

}  // namespace

LaneTimeScale::LaneTimeScale(double scale) : previous_(lane_time_scale) {
  lane_time_scale = scale;
}

LaneTimeScale::~LaneTimeScale() {
  lane_time_scale = previous_;
}

LaneTime::LaneTime(Pipeline& pipeline, int64_t j, Phase phase)
    : pipeline_(pipeline), j_(j), phase_(phase), scale_(lane_time_scale) {
  if (scale_ > 0) {
    start_ = std::chrono::steady_clock::now();
  }
}

void LaneTime::keep() {
  if (scale_ > 0) {
    pipeline_.set_lane_cell_seconds(
        j_,
        phase_,
        scale_ * std::chrono::duration<double>(
                     std::chrono::steady_clock::now() - start_)
                     .count());
  }
}

}  // namespace gpipe::detail
