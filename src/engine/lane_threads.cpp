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
// backward 2, each part of a split backward 1). A plan that never runs two
// sharing lanes at once (every plan at chunks 1) runs on the calling
// thread, with every core (Note [A serial plan on the calling thread] in
// runner.cpp), unless the pipeline also has a lane on another device. Every
// other plan runs each cell on its own lane, with the lane's count, except
// the long cells it runs alone (the fill and the drain), which go to the
// calling thread with every core (Note [Wide cells on the calling thread]
// in wide_cells.cpp): short ones stay on their lanes, because after a parallel
// region GNU OpenMP's workers spin (300,000 turns, unless OMP_WAIT_POLICY or
// GOMP_SPINCOUNT say otherwise) before they sleep, on a core the lanes want
// back: a model of cells of a few ms loses more to that than every core
// wins it, one of tens of ms gains (docs/benchmark-history.md).

// Why the calling thread rather than each lane growing its own pool when
// alone:
// GNU OpenMP counts the threads of every pool in the process, idle ones
// included, and once they outnumber the cores it spins only about 100 times
// at a barrier before it sleeps in the kernel. Two lanes that had each
// grown a pool of 2 on 2 cores made every barrier of a conv layer a futex
// wait: 5,400 context switches in 34 steps against 130, and 10% of the
// plain model's speed. With one wide thread the pools hold the cores once
// (lanes of one thread each when there are no more cores than lanes), and
// the calling thread is the one a user's own parallel ops use already.
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

IntraOpThreads::IntraOpThreads(int64_t threads)
    : previous_(at::get_num_threads()) {
  const auto set = openmp_set_num_threads();
  const auto count = static_cast<int>(threads);
  if (set == nullptr || count == previous_) {
    return;
  }
  set(count);
  // Not taken: LibTorch runs another OpenMP runtime than the one found.
  changed_ = at::get_num_threads() == count;
}

IntraOpThreads::~IntraOpThreads() {
  if (changed_) {
    openmp_set_num_threads()(previous_);
  }
}

}  // namespace gpipe::detail
