// Zero bubble (ZB-H1 of Qi et al., 2023): 1F1B with every backward split
// into its input part (B), which goes upstream at once, and its weight part
// (W), which stage j defers by j micro-batches. The deferred Ws fill the
// drain's bubble, and every stage holds at most n micro-batches (1F1B's
// first stage holds as many). With F, B and W of one cost the bubble is
// (n - 1) units per lane against 1F1B's 3 (n - 1).

#include <gpipe/plan.h>

#include <algorithm>
#include <deque>

#include "schedule/plan_builders.h"

namespace gpipe::detail {

namespace {

std::vector<Cell> zero_bubble_stage(int64_t m, int64_t n, int64_t j) {
  std::vector<Cell> cells;
  std::deque<int64_t> pending;  // input parts done, weight parts not
  auto input_part = [&](int64_t i) {
    cells.push_back(Cell{i, j, Phase::BackwardInput});
    pending.push_back(i);
    if (static_cast<int64_t>(pending.size()) > j) {
      cells.push_back(Cell{pending.front(), j, Phase::BackwardWeight});
      pending.pop_front();
    }
  };
  const int64_t warmup = std::min(n - j - 1, m);
  for (int64_t i = 0; i < warmup; ++i) {
    cells.push_back(Cell{i, j, Phase::Forward});
  }
  for (int64_t k = 0; k < m - warmup; ++k) {
    cells.push_back(Cell{warmup + k, j, Phase::Forward});
    input_part(k);
  }
  for (int64_t i = m - warmup; i < m; ++i) {
    input_part(i);
  }
  for (const auto i : pending) {
    cells.push_back(Cell{i, j, Phase::BackwardWeight});
  }
  return cells;
}

}  // namespace

std::vector<Cell> zero_bubble_lane(int64_t m, int64_t n, int64_t j) {
  return zero_bubble_stage(m, n, j);
}

std::vector<std::vector<Cell>> zero_bubble_rows(int64_t m, const Placement& p) {
  return folded_rows(m, p, &zero_bubble_lane);
}

}  // namespace gpipe::detail
