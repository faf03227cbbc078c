// 1F1B (PipeDream-flush): stage j warms up with the forwards the later
// stages need before the first backward comes back, then alternates one
// forward and one backward, then drains the backwards. Stage j holds at
// most n - j micro-batches between their forward and their backward.

#include <gpipe/schedule.h>

#include <algorithm>

#include "schedule/plan_builders.h"

namespace gpipe::detail {

std::vector<Cell> one_f_one_b_lane(int64_t m, int64_t n, int64_t j) {
  std::vector<Cell> cells;
  const int64_t warmup = std::min(n - j - 1, m);
  for (int64_t i = 0; i < warmup; ++i) {
    cells.push_back(Cell{i, j, Phase::Forward});
  }
  for (int64_t k = 0; k < m - warmup; ++k) {
    cells.push_back(Cell{warmup + k, j, Phase::Forward});
    cells.push_back(Cell{k, j, Phase::Backward});
  }
  for (int64_t i = m - warmup; i < m; ++i) {
    cells.push_back(Cell{i, j, Phase::Backward});
  }
  return cells;
}

std::vector<std::vector<Cell>> one_f_one_b_rows(int64_t m, const Placement& p) {
  return folded_rows(m, p, &one_f_one_b_lane);
}

}  // namespace gpipe::detail
