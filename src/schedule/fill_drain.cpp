// Fill-drain (GPipe): every forward in clock cycles, then every backward in
// the reversed cycles.

#include <gpipe/plan.h>

#include <algorithm>

#include "schedule/plan_builders.h"

namespace gpipe {

Steps clock_cycles(int64_t m, int64_t n) {
  detail::check_sizes(m, n);
  Steps steps;
  if (m == 0 || n == 0) {
    return steps;
  }
  for (int64_t k = 0; k < m + n - 1; ++k) {
    std::vector<Cell> step;
    for (int64_t j = std::max<int64_t>(1 + k - m, 0);
         j < std::min<int64_t>(1 + k, n);
         ++j) {
      step.push_back(Cell{k - j, j, Phase::Forward});
    }
    steps.push_back(std::move(step));
  }
  return steps;
}

Steps reverse_clock_cycles(int64_t m, int64_t n) {
  Steps steps = clock_cycles(m, n);
  std::reverse(steps.begin(), steps.end());
  for (auto& step : steps) {
    std::reverse(step.begin(), step.end());
    for (auto& cell : step) {
      cell.phase = Phase::Backward;
    }
  }
  return steps;
}

namespace detail {

// Stage j's cells of clock_cycles and reverse_clock_cycles: the forward of
// micro-batch i runs at cycle i + j, so forwards in ascending order and
// backwards in descending order (written directly: taking them out of the
// cycles for each stage made a plan cost quadratic time in the stages).
std::vector<Cell> fill_drain_lane(int64_t m, int64_t /*n*/, int64_t j) {
  std::vector<Cell> cells;
  cells.reserve(static_cast<size_t>(2 * m));
  for (int64_t i = 0; i < m; ++i) {
    cells.push_back(Cell{i, j, Phase::Forward});
  }
  for (int64_t i = m - 1; i >= 0; --i) {
    cells.push_back(Cell{i, j, Phase::Backward});
  }
  return cells;
}

std::vector<std::vector<Cell>> fill_drain_rows(int64_t m, const Placement& p) {
  return folded_rows(m, p, &fill_drain_lane);
}

}  // namespace detail

Plan forward_plan(int64_t m, int64_t n) {
  return detail::plan_of_steps(clock_cycles(m, n), m, n);
}

Plan backward_plan(int64_t m, int64_t n) {
  return detail::plan_of_steps(reverse_clock_cycles(m, n), m, n);
}

}  // namespace gpipe
