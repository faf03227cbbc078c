// make_plan: a schedule's training step on a placement, lanes that may hold
// several stages each.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include "schedule/plan_builders.h"

namespace gpipe {

namespace detail {

// Each lane runs its stages' cells in the order of `flat`'s time steps.
// Every cell's inputs ran in an earlier step, so the order of steps is one
// order for all lanes and the folded plan cannot deadlock.
Plan fold_onto_lanes(const Plan& flat, const Placement& placement) {
  Plan plan;
  plan.micro_batches = flat.micro_batches;
  plan.stages = flat.stages;
  plan.placement = placement;
  plan.lanes.resize(static_cast<size_t>(placement.lanes()));
  for (const auto& step : flat.steps()) {
    for (const auto& cell : step) {
      plan.lanes[static_cast<size_t>(placement.lane_of(cell.partition))]
          .push_back(cell);
    }
  }
  return plan;
}

std::vector<std::vector<Cell>> folded_rows(
    int64_t m,
    const Placement& placement,
    std::vector<Cell> (*order)(int64_t, int64_t, int64_t)) {
  const auto n = placement.stages();
  check_sizes(m, n);
  Plan flat;
  flat.micro_batches = m;
  flat.stages = n;
  for (int64_t j = 0; j < n; ++j) {
    flat.lanes.push_back(order(m, n, j));
  }
  return fold_onto_lanes(flat, placement).lanes;
}

Placement one_stage_per_lane(int64_t lanes, int64_t stages_per_lane) {
  return Placement::modulo(lanes, stages_per_lane == 0 ? 1 : stages_per_lane);
}

Placement two_stages_per_lane(int64_t lanes, int64_t stages_per_lane) {
  return Placement::modulo(lanes, stages_per_lane == 0 ? 2 : stages_per_lane);
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
    Schedule schedule, int64_t micro_batches, const Placement& placement) {
  TORCH_CHECK_VALUE(
      micro_batches >= 0,
      "make_plan: expected micro_batches >= 0, but got ",
      micro_batches);
  TORCH_CHECK_VALUE(
      !placement.empty(), "make_plan: expected a placement, but got none");
  Plan plan;
  plan.micro_batches = micro_batches;
  plan.stages = placement.stages();
  plan.placement = placement;
  plan.lanes = detail::schedule_entry(schedule).rows(micro_batches, placement);
  return detail::with_losses(std::move(plan));
}

Placement placement_for(
    Schedule schedule, int64_t lanes, int64_t stages_per_lane) {
  TORCH_CHECK_VALUE(
      lanes >= 1, "placement_for: expected lanes >= 1, but got ", lanes);
  TORCH_CHECK_VALUE(
      stages_per_lane >= 0,
      "placement_for: expected stages_per_lane >= 0 (0: the schedule's own "
      "choice), but got ",
      stages_per_lane);
  return detail::schedule_entry(schedule).placement(lanes, stages_per_lane);
}

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
      stages_per_lane >= 0,
      "make_plan: expected stages_per_lane >= 0 (0: the schedule's own "
      "choice), but got ",
      stages_per_lane);
  return make_plan(
      schedule, micro_batches, placement_for(schedule, lanes, stages_per_lane));
}

}  // namespace gpipe
