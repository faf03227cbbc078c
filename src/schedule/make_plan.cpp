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
  const auto lanes = placement.lanes();
  const auto stages = placement.stages();
  Plan plan;
  plan.micro_batches = micro_batches;
  plan.stages = stages;
  plan.placement = placement;
  switch (schedule) {
    case Schedule::Interleaved1F1B:
      if (lanes < stages) {
        TORCH_CHECK_VALUE(
            placement.is_modulo(),
            "make_plan: interleaved runs stage j on lane j % lanes "
            "(Placement::modulo), but the placement is ",
            to_string(placement));
        plan.lanes =
            detail::interleaved_lanes(micro_batches, lanes, stages / lanes);
        return detail::with_losses(std::move(plan));
      }
      break;  // one stage per lane: 1F1B
    case Schedule::ZeroBubbleV:
      TORCH_CHECK_VALUE(
          placement.is_v_shape(),
          "make_plan: zero_bubble_v runs on Placement::v_shape (stage j and ",
          "2 lanes - 1 - j on lane j), but the placement is ",
          to_string(placement));
      plan.lanes = detail::zero_bubble_v_lanes(micro_batches, lanes);
      return detail::with_losses(std::move(plan));
    case Schedule::LoopedBFS:
      plan.lanes = detail::looped_bfs_lanes(micro_batches, placement);
      return detail::with_losses(std::move(plan));
    case Schedule::FillDrain:
    case Schedule::OneFOneB:
    case Schedule::ZeroBubble:
      break;
  }
  return detail::with_losses(detail::fold_onto_lanes(
      training_plan(schedule, micro_batches, stages), placement));
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
      stages_per_lane >= 1,
      "make_plan: expected stages_per_lane >= 1, but got ",
      stages_per_lane);
  if (schedule == Schedule::ZeroBubbleV) {
    TORCH_CHECK_VALUE(
        stages_per_lane == 2,
        "make_plan: zero_bubble_v runs 2 stages on each lane "
        "(Placement::v_shape), but got stages_per_lane ",
        stages_per_lane);
    return make_plan(schedule, micro_batches, Placement::v_shape(lanes));
  }
  return make_plan(
      schedule, micro_batches, Placement::modulo(lanes, stages_per_lane));
}

}  // namespace gpipe
