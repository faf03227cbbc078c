// The functions of gpipe/schedule.h over cells and schedules: names,
// spelling, each schedule's lane order and in-flight counts.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>
#include <gpipe/schedule.h>

#include <algorithm>
#include <string>
#include <vector>

#include "schedule/plan_builders.h"

namespace gpipe {

std::vector<Cell> cells_of_partition(const Steps& steps, int64_t partition) {
  std::vector<Cell> cells;
  for (const auto& step : steps) {
    for (const auto& cell : step) {
      if (cell.partition == partition) {
        cells.push_back(cell);
      }
    }
  }
  return cells;
}

namespace detail {

const char* action_letter(Phase phase) {
  switch (phase) {
    case Phase::Forward:
      return "F";
    case Phase::Backward:
    case Phase::BackwardInput:
      return "B";
    case Phase::BackwardWeight:
      return "W";
    case Phase::Loss:
      return "L";
    case Phase::SendForward:
      return "SEND_F";
    case Phase::RecvForward:
      return "RECV_F";
    case Phase::SendBackward:
      return "SEND_B";
    case Phase::RecvBackward:
      return "RECV_B";
  }
  return "?";
}

}  // namespace detail

std::string to_string(const Cell& cell) {
  const char* letter = cell.phase == Phase::BackwardInput
                           ? "I"
                           : detail::action_letter(cell.phase);
  return std::string(letter) + "(" + std::to_string(cell.micro_batch) + "," +
         std::to_string(cell.partition) + ")";
}

std::string to_string(Schedule schedule) {
  switch (schedule) {
    case Schedule::FillDrain:
      return "fill_drain";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved1F1B:
      return "interleaved";
    case Schedule::ZeroBubble:
      return "zero_bubble";
    case Schedule::ZeroBubbleV:
      return "zero_bubble_v";
    case Schedule::LoopedBFS:
      return "looped_bfs";
  }
  return "unknown";
}

Schedule schedule_from_string(const std::string& name) {
  for (auto s :
       {Schedule::FillDrain,
        Schedule::OneFOneB,
        Schedule::Interleaved1F1B,
        Schedule::ZeroBubble,
        Schedule::ZeroBubbleV,
        Schedule::LoopedBFS}) {
    if (name == to_string(s)) {
      return s;
    }
  }
  TORCH_CHECK_VALUE(
      false,
      "schedule must be 'fill_drain', '1f1b', 'interleaved', 'zero_bubble', "
      "'zero_bubble_v' or 'looped_bfs', but got '",
      name,
      "'");
}

std::vector<Cell> lane_order(
    Schedule schedule, int64_t m, int64_t n, int64_t j) {
  detail::check_sizes(m, n);
  TORCH_CHECK_INDEX(
      j >= 0 && j < n, "schedule: partition ", j, " is not in [0, ", n, ")");
  switch (schedule) {
    case Schedule::FillDrain:
    case Schedule::LoopedBFS:  // one stage per lane: fill-drain
      return detail::fill_drain_lane(m, n, j);
    case Schedule::OneFOneB:
    case Schedule::Interleaved1F1B:  // one stage per lane: 1F1B
      return detail::one_f_one_b_lane(m, n, j);
    case Schedule::ZeroBubble:
      return detail::zero_bubble_lane(m, n, j);
    case Schedule::ZeroBubbleV:
      TORCH_CHECK_VALUE(
          false,
          "schedule: zero_bubble_v runs two stages on each lane "
          "(Placement::v_shape), so it has no one-lane-per-stage order; "
          "use make_plan(Schedule::ZeroBubbleV, micro_batches, lanes, 2)");
  }
  TORCH_CHECK_VALUE(
      false, "schedule: unknown schedule ", static_cast<int>(schedule));
}

int64_t max_in_flight(const std::vector<Cell>& cells) {
  int64_t in_flight = 0;
  int64_t most = 0;
  for (const auto& c : cells) {
    if (c.phase == Phase::Forward) {
      ++in_flight;
    } else if (c.phase == Phase::Backward || c.phase == Phase::BackwardWeight) {
      --in_flight;
    }
    most = std::max(most, in_flight);
  }
  return most;
}

}  // namespace gpipe
