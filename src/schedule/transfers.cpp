// Transfers in plans: checking the ones a plan lists, and placing them
// (`Plan::with_transfers`).

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "schedule/actions.h"
#include "schedule/plan_builders.h"

namespace gpipe {

namespace detail {

// A plan that lists transfers lists each message between lanes once, and
// nothing else.
void validate_transfers(
    const Plan& plan,
    const std::map<int64_t, size_t>& stage_lane,
    const std::vector<std::pair<int64_t, int64_t>>& pairs,
    const std::function<bool(int64_t, int64_t, Phase)>& has) {
  auto crosses = [&](int64_t j) {  // between stages j and j + 1
    auto a = stage_lane.find(j);
    auto b = stage_lane.find(j + 1);
    return a != stage_lane.end() && b != stage_lane.end() &&
           a->second != b->second;
  };
  auto backward = [&](int64_t i, int64_t j) {
    return has(i, j, Phase::Backward) || has(i, j, Phase::BackwardInput);
  };
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    for (const auto& c : plan.lanes[l]) {
      if (!is_transfer(c.phase)) {
        continue;
      }
      const auto i = c.micro_batch;
      const auto j = c.partition;
      const bool forward =
          c.phase == Phase::SendForward || c.phase == Phase::RecvForward;
      // The message goes between stages `lower` and `lower + 1`.
      const auto lower =
          c.phase == Phase::SendForward || c.phase == Phase::RecvBackward
              ? j
              : j - 1;
      TORCH_CHECK_VALUE(
          lower >= 0 && lower + 1 < plan.stages,
          "plan: ",
          to_string(c),
          " moves a message to or from a stage outside 0..",
          plan.stages - 1);
      TORCH_CHECK_VALUE(
          crosses(lower),
          "plan: ",
          to_string(c),
          " moves a message between stages ",
          lower,
          " and ",
          lower + 1,
          ", which run on the same lane ",
          l,
          "; a plan lists only messages between lanes");
      const Phase kind = forward ? Phase::Forward : Phase::Backward;
      TORCH_CHECK_VALUE(
          forward ? has(i, lower, Phase::Forward) &&
                        has(i, lower + 1, Phase::Forward)
                  : backward(i, lower) && backward(i, lower + 1),
          "plan: ",
          to_string(c),
          " moves a message between ",
          to_string(Cell{i, lower, kind}),
          " and ",
          to_string(Cell{i, lower + 1, kind}),
          ", but the plan does not run both");
    }
  }
  // A message is needed only between two cells the plan runs, so the pairs
  // its actions name (in order) are the ones to look at.
  for (const auto& [i, j] : pairs) {
    if (j + 1 >= plan.stages || !crosses(j)) {
      continue;
    }
    std::vector<Cell> needed;
    if (has(i, j, Phase::Forward) && has(i, j + 1, Phase::Forward)) {
      needed.push_back(Cell{i, j, Phase::SendForward});
      needed.push_back(Cell{i, j + 1, Phase::RecvForward});
    }
    if (backward(i, j) && backward(i, j + 1)) {
      needed.push_back(Cell{i, j + 1, Phase::SendBackward});
      needed.push_back(Cell{i, j, Phase::RecvBackward});
    }
    for (const auto& t : needed) {
      TORCH_CHECK_VALUE(
          has(t.micro_batch, t.partition, t.phase),
          "plan: it lists transfers, but not ",
          to_string(t),
          " (micro-batch ",
          i,
          " between stages ",
          j,
          " and ",
          j + 1,
          ", on different lanes); list every message between lanes, or "
          "none");
    }
  }
}

}  // namespace detail

Plan Plan::with_transfers() const {
  Plan plan;
  plan.micro_batches = micro_batches;
  plan.stages = stages;
  plan.placement = placement;
  plan.lanes.resize(lanes.size());
  std::vector<int64_t> lane(static_cast<size_t>(stages), -1);
  for (size_t l = 0; l < lanes.size(); ++l) {
    for (const auto& c : lanes[l]) {
      if (c.partition >= 0 && c.partition < stages) {
        lane[static_cast<size_t>(c.partition)] = static_cast<int64_t>(l);
      }
    }
  }
  auto crosses = [&](int64_t j) {  // between stages j and j + 1
    return j >= 0 && j + 1 < stages && lane[j] >= 0 && lane[j + 1] >= 0 &&
           lane[j] != lane[j + 1];
  };
  for (size_t l = 0; l < lanes.size(); ++l) {
    // Compute actions with the receives they need, and where each receive
    // goes: before the compute action that precedes its consumer, so that
    // the message can arrive while the lane computes.
    std::vector<Cell> row;
    size_t previous_compute = 0;  // index in row of the last compute action
    bool any_compute = false;
    for (const auto& c : lanes[l]) {
      if (is_transfer(c.phase)) {
        continue;  // replaced
      }
      const auto i = c.micro_batch;
      const auto j = c.partition;
      const bool compute = detail::action_info(c.phase).step;
      std::vector<Cell> receives;
      if (c.phase == Phase::Forward && crosses(j - 1)) {
        receives.push_back(Cell{i, j, Phase::RecvForward});
      }
      if (detail::action_info(c.phase).sends_gradient && crosses(j)) {
        receives.push_back(Cell{i, j, Phase::RecvBackward});
      }
      const auto at = any_compute ? previous_compute : row.size();
      row.insert(
          row.begin() + static_cast<std::ptrdiff_t>(at),
          receives.begin(),
          receives.end());
      if (any_compute) {
        previous_compute += receives.size();
      }
      if (compute) {
        previous_compute = row.size();
        any_compute = true;
      }
      row.push_back(c);
      if (c.phase == Phase::Forward && crosses(j)) {
        row.push_back(Cell{i, j, Phase::SendForward});
      }
      if (detail::action_info(c.phase).sends_gradient && crosses(j - 1)) {
        row.push_back(Cell{i, j, Phase::SendBackward});
      }
    }
    plan.lanes[l] = std::move(row);
  }
  return plan;
}

}  // namespace gpipe
