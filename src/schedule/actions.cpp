// The table of Note [One table of actions].

#include "schedule/actions.h"

#include <c10/util/Exception.h>

namespace gpipe::detail {

namespace {

// What each action waits for (ActionInfo::waits_for).

// A forward: the previous stage's forward, or, where the plan lists the
// message between their lanes, its receive and its send.
std::vector<Cell> forward_waits(const Cell& c, int64_t, const PlanShape& s) {
  const auto i = c.micro_batch;
  const auto j = c.partition;
  if (j == 0) {
    return {};
  }
  if (s.listed_transfer(j - 1)) {
    return {Cell{i, j, Phase::RecvForward}, Cell{i, j - 1, Phase::SendForward}};
  }
  return {Cell{i, j - 1, Phase::Forward}};
}

// A whole backward or its input part: its forward (when the plan lists
// forwards), its loss on the last stage (when listed), and the next stage's
// backward, or the receive and send of its message.
std::vector<Cell> backward_waits(const Cell& c, int64_t n, const PlanShape& s) {
  const auto i = c.micro_batch;
  const auto j = c.partition;
  std::vector<Cell> waits;
  if (s.forward) {
    waits.push_back(Cell{i, j, Phase::Forward});
  }
  if (s.loss && j + 1 == n) {
    waits.push_back(Cell{i, j, Phase::Loss});
  }
  if (j + 1 < n && s.listed_transfer(j)) {
    waits.push_back(Cell{i, j, Phase::RecvBackward});
    waits.push_back(Cell{i, j + 1, Phase::SendBackward});
  } else if (j + 1 < n) {
    waits.push_back(Cell{
        i,
        j + 1,
        s.is_split(i, j + 1) ? Phase::BackwardInput : Phase::Backward});
  }
  return waits;
}

// A weight part: its input part.
std::vector<Cell> weight_waits(const Cell& c, int64_t, const PlanShape&) {
  return {Cell{c.micro_batch, c.partition, Phase::BackwardInput}};
}

// A loss, or the send of an output: the forward that made it.
std::vector<Cell> after_forward(const Cell& c, int64_t, const PlanShape&) {
  return {Cell{c.micro_batch, c.partition, Phase::Forward}};
}

// The send of an input's gradient: the backward (or input part) that made
// it.
std::vector<Cell> after_backward(const Cell& c, int64_t, const PlanShape& s) {
  const auto i = c.micro_batch;
  const auto j = c.partition;
  return {
      Cell{i, j, s.is_split(i, j) ? Phase::BackwardInput : Phase::Backward}};
}

// Posting a receive waits for nothing.
std::vector<Cell> nothing(const Cell&, int64_t, const PlanShape&) {
  return {};
}

}  // namespace

const std::vector<ActionInfo>& action_table() {
  // clang-format off
  static const std::vector<ActionInfo> table{
      // phase, letter, read_as, short_name, context, trace_kind,
      // step, transfer, sends_gradient, frees, cost, waits_for
      {Phase::Forward, "F", "F", "F", ", forward", TraceKind::Forward,
       true, false, false, false, &ActionCosts::forward, forward_waits},
      {Phase::Backward, "B", "B", "B", ", backward", TraceKind::Backward,
       true, false, true, true, &ActionCosts::backward, backward_waits},
      {Phase::BackwardInput, "B", "I", "I", ", backward (input part)",
       TraceKind::Backward,
       true, false, true, false, &ActionCosts::backward_input,
       backward_waits},
      {Phase::BackwardWeight, "W", "W", "W", ", backward (weight part)",
       TraceKind::Weight,
       true, false, false, true, &ActionCosts::backward_weight,
       weight_waits},
      {Phase::Loss, "L", "L", "L", ", loss", TraceKind::Loss,
       false, false, false, false, &ActionCosts::loss, after_forward},
      {Phase::SendForward, "SEND_F", "SEND_F", "SEND_F",
       ", sending the output", TraceKind::Send,
       false, true, false, false, nullptr, after_forward},
      {Phase::RecvForward, "RECV_F", "RECV_F", "RECV_F",
       ", posting the input's receive", TraceKind::Receive,
       false, true, false, false, nullptr, nothing},
      {Phase::SendBackward, "SEND_B", "SEND_B", "SEND_B",
       ", sending the input's gradient", TraceKind::Send,
       false, true, false, false, nullptr, after_backward},
      {Phase::RecvBackward, "RECV_B", "RECV_B", "RECV_B",
       ", posting the receive of the output's gradient",
       TraceKind::Receive,
       false, true, false, false, nullptr, nothing},
  };
  // clang-format on
  return table;
}

const ActionInfo& action_info(Phase phase) {
  const auto& table = action_table();
  const auto k = static_cast<size_t>(phase);
  TORCH_CHECK_VALUE(
      k < table.size() && table[k].phase == phase,
      "expected a gpipe::Phase, but got the value ",
      static_cast<int>(phase));
  return table[k];
}

}  // namespace gpipe::detail
