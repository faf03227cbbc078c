#pragma once

// The plan builders' shared pieces (private to src/schedule/).

#include <gpipe/plan.h>

#include <cstdint>
#include <vector>

namespace gpipe::detail {

/// Throws std::invalid_argument for negative sizes (callers validate user
/// input first; this guards the pure functions themselves).
void check_sizes(int64_t micro_batches, int64_t stages);

/// One lane per stage, each running its cells in the order `steps` gives.
Plan plan_of_steps(const Steps& steps, int64_t micro_batches, int64_t stages);

/// The cells stage j runs in a training step, one builder per schedule.
std::vector<Cell> fill_drain_lane(int64_t m, int64_t n, int64_t j);
std::vector<Cell> one_f_one_b_lane(int64_t m, int64_t n, int64_t j);

}  // namespace gpipe::detail
