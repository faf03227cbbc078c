#pragma once

// Threads that follow the plan: each cell's share of the cores when CPU
// lanes share them (a plan whose every cell has every core runs on the
// calling thread), and the calls that set a thread's count (Note [Threads
// that follow the plan] in lane_threads.cpp).

#include <cstdint>
#include <vector>

namespace gpipe {
struct Plan;
}  // namespace gpipe

namespace gpipe::detail {

/// Per lane and cell of `plan`: the intra-op threads the cell may run with
/// when the lanes marked in `shares_cores` share `cores` threads: `cores`
/// over the number of those lanes whose cells run beside it in `plan`'s
/// simulated timeline, at least 1; 0 for a cell that takes no time (a loss,
/// a message) or runs on a lane outside `shares_cores`. A plan whose every
/// cell gets `cores` runs on the calling thread; in another, a cell that
/// gets `cores` runs alone, on the calling thread if it is long (see
/// kWideCellSeconds), else on its lane, with the lane's own count.
std::vector<std::vector<int64_t>> threads_of_cells(
    const Plan& plan, const std::vector<bool>& shares_cores, int64_t cores);

/// In a plan whose CPU lanes overlap, a cell the plan runs alone (its
/// threads_of_cells count is every core) runs with every core on the
/// calling thread when its stage's last cell of that kind took at least this
/// long on its lane (Note [Wide cells on the calling thread] in
/// wide_cells.cpp); else on its lane, with the lane's count.
constexpr double kWideCellSeconds = 0.010;

/// Sets the calling thread's intra-op thread count to `threads` (a no-op
/// when it is that already) and no other thread's, without resizing
/// LibTorch's process-wide pthreadpool when the intra-op pool is OpenMP's.
void set_intra_op_threads(int64_t threads);

/// Sets the calling thread's intra-op thread count for its lifetime, and
/// puts the previous count back when it ends. Where the count cannot be
/// set for this thread alone (an intra-op pool that is not OpenMP's), the
/// thread keeps its count: at::set_num_threads would resize the process's
/// pool twice a pass.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int64_t threads);
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;
  ~IntraOpThreads();

 private:
  int previous_;
  bool changed_ = false;
};

}  // namespace gpipe::detail
