// Interleaved 1F1B (Megatron-LM, Narayanan et al., 2021). Each of the n
// lanes holds v stages, stage c n + l on lane l. A lane runs the forwards
// of n micro-batches through its first stage, then the same n through its
// second, and so on (a group), and the backwards of a group through its
// stages in reverse; it warms up with 2 (n - l - 1) + (v - 1) n forwards,
// then alternates one forward and one backward, then drains. The bubble
// shrinks by v, the forwards held grow by about the same.
//
// The warm-up counts assume the micro-batches come in whole groups of n.
// When they do not, a lane that would wait for ever warms up further,
// until the plan runs.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <algorithm>

#include "schedule/plan_builders.h"

namespace gpipe::detail {

namespace {

struct Orders {
  std::vector<Cell> forward;
  std::vector<Cell> backward;
};

Orders orders_of(int64_t m, int64_t n, int64_t v, int64_t l) {
  Orders o;
  for (int64_t first = 0; first < m; first += n) {
    const int64_t last = std::min(m, first + n);
    for (int64_t c = 0; c < v; ++c) {
      for (int64_t i = first; i < last; ++i) {
        o.forward.push_back(Cell{i, c * n + l, Phase::Forward});
      }
    }
    for (int64_t c = v - 1; c >= 0; --c) {
      for (int64_t i = first; i < last; ++i) {
        o.backward.push_back(Cell{i, c * n + l, Phase::Backward});
      }
    }
  }
  return o;
}

std::vector<Cell> lane_cells(const Orders& o, int64_t warmup) {
  const auto total = static_cast<int64_t>(o.forward.size());
  warmup = std::min(warmup, total);
  std::vector<Cell> cells(o.forward.begin(), o.forward.begin() + warmup);
  for (int64_t k = 0; k < total - warmup; ++k) {
    cells.push_back(o.forward[warmup + k]);
    cells.push_back(o.backward[k]);
  }
  cells.insert(cells.end(), o.backward.end() - warmup, o.backward.end());
  return cells;
}

bool runs(const std::vector<std::vector<Cell>>& rows, int64_t m, int64_t s) {
  Plan plan;
  plan.micro_batches = m;
  plan.stages = s;
  plan.lanes = rows;
  try {
    plan.steps();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace

namespace {

std::vector<std::vector<Cell>> interleaved_lanes(
    int64_t m, int64_t n, int64_t v) {
  check_sizes(m, n);
  std::vector<Orders> orders;
  std::vector<int64_t> warmups;
  for (int64_t l = 0; l < n; ++l) {
    orders.push_back(orders_of(m, n, v, l));
    warmups.push_back(v == 1 ? n - l - 1 : 2 * (n - l - 1) + (v - 1) * n);
  }
  // Every lane warmed up fully (all forwards, then all backwards) always
  // runs, so this ends.
  for (int64_t extra = 0;; ++extra) {
    std::vector<std::vector<Cell>> rows;
    bool capped = true;
    for (int64_t l = 0; l < n; ++l) {
      rows.push_back(lane_cells(orders[l], warmups[l] + extra));
      capped = capped && warmups[l] + extra >= m * v;
    }
    if (capped || runs(rows, m, n * v)) {
      return rows;
    }
  }
}

}  // namespace

// One stage per lane: 1F1B.
std::vector<std::vector<Cell>> interleaved_rows(int64_t m, const Placement& p) {
  if (p.lanes() == p.stages()) {
    return folded_rows(m, p, &one_f_one_b_lane);
  }
  TORCH_CHECK_VALUE(
      p.is_modulo(),
      "schedule: interleaved runs the same number of stages on every lane, "
      "stage j on lane j % lanes (Placement::modulo(lanes, stages_per_lane)), "
      "but the placement is ",
      to_string(p));
  return interleaved_lanes(m, p.lanes(), p.stages() / p.lanes());
}

}  // namespace gpipe::detail
