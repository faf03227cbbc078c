#pragma once

// The planner's model of a step (autotune.cpp searches with it).
// A stage's forward costs its layers' forward times,
// its input part their input-gradient times, its weight part their
// weight-gradient times (a whole backward both), each plus the engine's
// overhead per cell; a checkpointed micro-batch's backward also recomputes
// the forward. The last stage's loss costs the loss's time. `simulate` runs
// the plan with those costs, and with the lease on the random generators:
// on CPU lanes a stage with a layer that draws from the default generator
// itself (not through the random operators, which give a cell its own
// generator) runs its forwards, and the recomputations of its
// checkpointed backwards, beside no other forward (Note [Random streams of
// concurrent cells] in src/random.h; simulate_with_lease). With
// threads_per_lane 0 a plan whose lanes never work at once runs each cell on
// every core, profiled so. Memory, per lane, walks the lane's simulated actions
// in order: a forward keeps what the stage's layers keep (a checkpointed
// micro-batch only the stage's input), its backward (or its weight part) frees
// it; a checkpointed backward holds what the recomputed forward keeps while it
// runs (until the weight part, when split). The lane's peak of that, plus its
// parameters times param_scale, must fit the limit.

#include <gpipe/checkpoint.h>
#include <gpipe/plan.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "balance/layer_costs.h"

namespace gpipe::detail {

/// Sums of the layers' costs per stage.
struct StageCosts {
  std::vector<double> forward, input, weight, kept, in, params;
  std::vector<double> frozen;  // frozen parameters' bytes, held once
  // Some layer's forward draws from the default generator itself (its
  // cells hold the lease alone).
  std::vector<bool> draws;
};

/// The stages' costs under `balance`.
StageCosts stage_costs(
    const LayerCosts& c, const std::vector<int64_t>& balance);

/// Whether micro-batch `i` of `m` is checkpointed under `mode`.
bool checkpointed(Checkpoint mode, int64_t i, int64_t m);

/// A step's predicted time and each lane's peak bytes.
struct Evaluated {
  double seconds = 0;
  std::vector<double> peaks;
};

/// `plan` simulated with the stages' costs `s_own` (at the lanes' own
/// thread count; where `cell_threads`, the plan's threads_of_cells, gives
/// a cell a count and the engine would run it with that count, at
/// `at(count)`'s), `overhead` per cell, the loss's time from `costs`, and on
/// CPU lanes (`cpu`) the lease on the generators.
Evaluated evaluate(
    const Plan& plan,
    const StageCosts& s_own,
    const LayerCosts& costs,
    Checkpoint mode,
    double overhead,
    double param_scale,
    bool cpu,
    const std::vector<std::vector<int64_t>>& cell_threads = {},
    const std::function<const StageCosts&(int64_t)>& at = {});

}  // namespace gpipe::detail
