#pragma once

// simulate with the lease on the random generators (private to the
// library).

#include <gpipe/plan.h>

#include <functional>

namespace gpipe::detail {

/// How an action holds the process-wide lease of the default generators
/// (Note [Random streams of concurrent cells] in src/random.h): not at all
/// (a backward without recomputation), shared (a forward that draws
/// nothing, a loss), or exclusive (a forward that draws, on CPU lanes,
/// where the drawing is the work itself).
enum class Lease { None, Shared, Exclusive };

/// How an action holds the lease, and for how long from its start (a
/// negative time: all of it), e.g. a checkpointed backward only while it
/// recomputes the forward.
struct Held {
  Lease how = Lease::None;
  double seconds = -1;
};

/// `simulate(plan, costs)`, where an action that holds the lease
/// exclusively runs beside no other holder: it starts when none holds it,
/// and none takes it while it holds it. Ready actions take the lease in the
/// order of their earliest starts. Without `lease` it is `simulate`.
Simulation simulate_with_lease(
    const Plan& plan,
    const ActionCosts& costs,
    const std::function<Held(const Cell&)>& lease);

}  // namespace gpipe::detail
