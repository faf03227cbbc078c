// make_plan: a schedule's training step on lanes that may hold several
// stages each.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include "schedule/plan_builders.h"

namespace gpipe {

namespace detail {

// The one-lane-per-stage plan `flat` on `lanes` lanes, stage j on lane
// j % lanes: each lane runs its stages' cells in the order of `flat`'s time
// steps. Every cell's inputs ran in an earlier step, so the order of steps
// is one order for all lanes and the folded plan cannot deadlock.
Plan fold_onto_lanes(const Plan& flat, int64_t lanes) {
  Plan plan;
  plan.micro_batches = flat.micro_batches;
  plan.stages = flat.stages;
  plan.lanes.resize(static_cast<size_t>(lanes));
  for (const auto& step : flat.steps()) {
    for (const auto& cell : step) {
      plan.lanes[static_cast<size_t>(cell.partition % lanes)].push_back(cell);
    }
  }
  return plan;
}

Plan with_losses(Plan plan) {
  for (auto& lane : plan.lanes) {
    std::vector<Cell> cells;
    cells.reserve(lane.size());
    for (const auto& c : lane) {
      cells.push_back(c);
      if (c.phase == Phase::Forward && c.partition + 1 == plan.stages) {
        cells.push_back(Cell{c.micro_batch, c.partition, Phase::Loss});
      }
    }
    lane = std::move(cells);
  }
  return plan;
}

}  // namespace detail

Plan make_plan(
    Schedule schedule,
    int64_t micro_batches,
    int64_t lanes,
    int64_t stages_per_lane) {
  TORCH_CHECK_VALUE(
      micro_batches >= 0,
      "make_plan: expected micro_batches >= 0, but got ",
      micro_batches);
  TORCH_CHECK_VALUE(
      lanes >= 1, "make_plan: expected lanes >= 1, but got ", lanes);
  TORCH_CHECK_VALUE(
      stages_per_lane >= 1,
      "make_plan: expected stages_per_lane >= 1, but got ",
      stages_per_lane);
  const auto stages = lanes * stages_per_lane;
  if (schedule == Schedule::Interleaved1F1B && stages_per_lane > 1) {
    Plan plan;
    plan.micro_batches = micro_batches;
    plan.stages = stages;
    plan.lanes =
        detail::interleaved_lanes(micro_batches, lanes, stages_per_lane);
    return detail::with_losses(std::move(plan));
  }
  auto flat = training_plan(schedule, micro_batches, stages);
  return detail::with_losses(
      stages_per_lane == 1 ? std::move(flat)
                           : detail::fold_onto_lanes(flat, lanes));
}

}  // namespace gpipe
