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
// A CPU lane is a thread with its own intra-op pool of cores / lanes
// threads. A lane that the plan runs alone (every cell at chunks 1, the
// fill and the drain otherwise) then leaves the other lanes' cores idle: 2
// lanes at chunks 1 ran at about half the plain model's speed on 2 threads.
// When GPipeOptions::threads_per_lane is 0, the lanes share the cores: each
// cell's share is the cores over the number of CPU lanes whose cells run
// beside it in the plan's simulated timeline (unit costs: a forward 1, a
// backward 2, each part of a split backward 1), and a cell whose share is
// every core (one that no other lane runs beside) is computed on the
// pipeline's wide lane, a thread whose pool has every core, while its own
// lane waits; its lane still takes its messages and sends its results, so
// the wide lane never waits on another lane. The timeline is the plan's,
// not the clock's: two cells the plan runs alone that meet at run time take
// turns on the wide lane.
//
// Why a wide lane rather than each lane growing its own pool when alone:
// GNU OpenMP counts the threads of every pool in the process, idle ones
// included, and once they outnumber the cores it spins only about 100 times
// at a barrier before it sleeps in the kernel. Two lanes that had each
// grown a pool of 2 on 2 cores made every barrier of a conv layer a futex
// wait: 5,400 context switches in 34 steps against 130, and 10% of the
// plain model's speed. With the wide lane the pools hold the cores once
// (lanes of one thread each when there are no more cores than lanes). A
// caller that runs its own parallel ops on several threads (a
// torch::set_num_threads(2) on the main thread) adds a pool of its own.
//
// A lane's count is set through the omp_set_num_threads of the OpenMP
// runtime LibTorch loaded (looked up at run time: a pip wheel bundles its
// own libgomp under another file name, and linking ours would make a
// second runtime). at::set_num_threads would also resize LibTorch's
// process-wide pthreadpool (about 50 us a call) and set the count every
// thread starts with: a lane that called it made the caller's thread, if
// it had not run a parallel op yet, start with the lane's count (a user's
// torch::set_num_threads(2) before building a GPipe became 1). Where the
// OpenMP call is not found, or did not take, at::set_num_threads is called.

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
