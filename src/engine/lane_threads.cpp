#include "engine/lane_threads.h"

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <gpipe/plan.h>

#include <algorithm>

#if AT_PARALLEL_OPENMP && defined(__linux__)
#include <dlfcn.h>
#endif

#include "schedule/actions.h"

namespace gpipe::detail {

// Note [Threads that follow the plan]
// A CPU lane is a thread with its own intra-op pool. With a fixed count per
// lane (cores / lanes), a lane that the plan runs alone (every cell at
// chunks 1, the fill and the drain otherwise) leaves the other lanes' cores
// idle: 2 lanes at chunks 1 ran at about half the plain model's speed on 2
// threads. When GPipeOptions::threads_per_lane is 0, the lanes share the
// cores instead: before each cell, its lane takes the cores over the number
// of CPU lanes whose cells run beside it in the plan's simulated timeline
// (unit costs: a forward 1, a backward 2, each part of a split backward 1),
// so a cell the plan runs alone gets every core and cells that run together
// split them. The timeline is the plan's, not the clock's: a cell that
// starts early or late may briefly share a core, but no lane waits for
// another to hand threads over.
//
// at::set_num_threads also resizes LibTorch's process-wide pthreadpool
// (used by XNNPACK and NNPACK, not by the OpenMP kernels nor by OpenBLAS):
// about 50 us a call when the count changes, which is more than a small
// cell's work, and a lock shared by every lane. Where the intra-op pool is
// OpenMP's, only the calling thread's OpenMP count matters (OpenMP keeps it
// per thread, and OpenBLAS's OpenMP build reads it per call), so the lanes
// set that alone, through the omp_set_num_threads of the OpenMP runtime
// LibTorch loaded (looked up at run time: a pip wheel bundles its own
// libgomp under another file name, and linking ours would make a second
// runtime). Where that is not found, or did not take, at::set_num_threads
// is called. at::set_num_threads also sets the count every thread starts
// with: a lane that called it made the caller's thread, if it had not run a
// parallel op yet, start with the lane's count (a user's
// torch::set_num_threads(2) before building a GPipe became 1 on its own
// thread); the lanes' own counts now stay theirs.

std::vector<std::vector<int64_t>> threads_of_cells(
    const Plan& plan, const std::vector<bool>& shares_cores, int64_t cores) {
  const auto lanes = plan.lanes.size();
  std::vector<std::vector<int64_t>> threads(lanes);
  const auto sim = simulate(plan);
  for (const auto l : c10::irange(lanes)) {
    threads[l].assign(plan.lanes[l].size(), 0);
    if (l >= shares_cores.size() || !shares_cores[l]) {
      continue;
    }
    // simulate keeps each lane's actions in its row's order.
    TORCH_INTERNAL_ASSERT(sim.lanes[l].size() == plan.lanes[l].size());
    for (const auto k : c10::irange(sim.lanes[l].size())) {
      const auto& a = sim.lanes[l][k];
      if (!action_info(a.cell.phase).step || a.end <= a.start) {
        continue;
      }
      int64_t beside = 1;
      for (const auto o : c10::irange(lanes)) {
        if (o == l || o >= shares_cores.size() || !shares_cores[o]) {
          continue;
        }
        const auto& row = sim.lanes[o];
        const bool overlaps =
            std::any_of(row.begin(), row.end(), [&](const auto& b) {
              return action_info(b.cell.phase).step &&
                     std::min(a.end, b.end) > std::max(a.start, b.start);
            });
        beside += overlaps ? 1 : 0;
      }
      threads[l][k] = std::max<int64_t>(1, cores / beside);
    }
  }
  return threads;
}

namespace {

using SetThreads = void (*)(int);

SetThreads openmp_set_num_threads() {
#if AT_PARALLEL_OPENMP && defined(__linux__)
  static const auto found =
      reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  return found;
#else
  return nullptr;
#endif
}

}  // namespace

void set_intra_op_threads(int64_t threads) {
  const auto count = static_cast<int>(threads);
  if (at::get_num_threads() == count) {
    return;
  }
  if (const auto set = openmp_set_num_threads()) {
    set(count);
    // at::get_num_threads reads the OpenMP runtime LibTorch uses: if ours
    // was another, this did not take.
    if (at::get_num_threads() == count) {
      return;
    }
  }
  at::set_num_threads(count);
}

}  // namespace gpipe::detail
