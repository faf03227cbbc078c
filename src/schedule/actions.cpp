// The table of Note [One table of actions].

#include "schedule/actions.h"

#include <c10/util/Exception.h>

namespace gpipe::detail {

const std::vector<ActionInfo>& action_table() {
  // clang-format off
  static const std::vector<ActionInfo> table{
      // phase, letter, read_as, short_name, context,
      // step, transfer, sends_gradient, frees, cost
      {Phase::Forward, "F", "F", "F", ", forward",
       true, false, false, false, &ActionCosts::forward},
      {Phase::Backward, "B", "B", "B", ", backward",
       true, false, true, true, &ActionCosts::backward},
      {Phase::BackwardInput, "B", "I", "I", ", backward (input part)",
       true, false, true, false, &ActionCosts::backward_input},
      {Phase::BackwardWeight, "W", "W", "W", ", backward (weight part)",
       true, false, false, true, &ActionCosts::backward_weight},
      {Phase::Loss, "L", "L", "L", ", loss",
       false, false, false, false, &ActionCosts::loss},
      {Phase::SendForward, "SEND_F", "SEND_F", "SEND_F",
       ", sending the output",
       false, true, false, false, nullptr},
      {Phase::RecvForward, "RECV_F", "RECV_F", "RECV_F",
       ", posting the input's receive",
       false, true, false, false, nullptr},
      {Phase::SendBackward, "SEND_B", "SEND_B", "SEND_B",
       ", sending the input's gradient",
       false, true, false, false, nullptr},
      {Phase::RecvBackward, "RECV_B", "RECV_B", "RECV_B",
       ", posting the receive of the output's gradient",
       false, true, false, false, nullptr},
  };
  // clang-format on
  return table;
}

const ActionInfo& action_info(Phase phase) {
  const auto& table = action_table();
  const auto k = static_cast<size_t>(phase);
  TORCH_INTERNAL_ASSERT(k < table.size() && table[k].phase == phase);
  return table[k];
}

}  // namespace gpipe::detail
