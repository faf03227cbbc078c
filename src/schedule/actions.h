#pragma once

// Note [One table of actions]
// What each kind of action in a plan is, in one place: how CSV and the
// tables spell it, how errors name it, whether it takes a time step or is
// instant (a loss, a message), whether it is a message between lanes,
// whether it is a backward that sends the input's gradient upstream,
// whether it ends what a micro-batch holds on its stage, and which field of
// ActionCosts prices it, and which actions it waits for. Validation, the
// unit-time steps, the simulation, CSV, the printed tables and the
// runner's error messages read this table instead of each switching over
// Phase; what each action does is the runner's.

#include <gpipe/plan.h>
#include <gpipe/schedule.h>
#include <gpipe/trace.h>

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace gpipe::detail {

// A cell as sets and maps of cells key it: (micro-batch, stage, action).
using CellKey = std::tuple<int64_t, int64_t, int>;

inline CellKey key_of(const Cell& c) {
  return {c.micro_batch, c.partition, static_cast<int>(c.phase)};
}

// What a plan holds: whether it has forwards, and which cells split their
// backward (their inputs differ).
struct PlanShape {
  bool forward = false;
  bool loss = false;  // losses are listed (else each follows its forward)
  // Transfers are listed (else messages move when cells end and start).
  bool transfers = false;
  std::set<std::pair<int64_t, int64_t>> split;  // (i, j) with an input part
  std::map<int64_t, size_t> lane;               // stage -> lane

  bool is_split(int64_t i, int64_t j) const {
    return split.count({i, j}) > 0;
  }
  // Messages between stages j and j + 1 go between lanes, and the plan
  // lists them.
  bool listed_transfer(int64_t j) const {
    if (!transfers) {
      return false;
    }
    auto a = lane.find(j);
    auto b = lane.find(j + 1);
    return a != lane.end() && b != lane.end() && a->second != b->second;
  }
};

struct ActionInfo {
  Phase phase;
  /// Written in CSV and the tables: F, B (a whole backward and an input
  /// part alike), W, L, SEND_F, RECV_F, SEND_B, RECV_B.
  const char* letter;
  /// Read from CSV too: I for an input part (as newer PyTorch writes it);
  /// else the letter.
  const char* read_as;
  /// In to_string(Cell): I for an input part, else the letter.
  const char* short_name;
  /// In error messages: ", forward", ", backward (input part)", ...
  const char* context;
  /// How a trace draws it (a failed one, and the lanes' own records).
  TraceKind trace_kind;
  /// Takes a time step (a compute action); a loss and a message are
  /// instant.
  bool step;
  /// A message between lanes.
  bool transfer;
  /// A whole backward or its input part: the input's gradient goes
  /// upstream when it ends.
  bool sends_gradient;
  /// What the micro-batch holds on the stage is freed when it ends (a
  /// whole backward, a weight part).
  bool frees;
  /// Its price in `simulate`; null: none (a message's time is
  /// ActionCosts::transfer, on its receiver).
  double ActionCosts::*cost;
  /// The actions `cell` (of this kind, in a plan of `stages` stages shaped
  /// as `shape`) waits for, in the order they are checked.
  std::vector<Cell> (*waits_for)(
      const Cell& cell, int64_t stages, const PlanShape& shape);
};

/// The entry of `phase`.
const ActionInfo& action_info(Phase phase);

/// Every entry, in Phase's order.
const std::vector<ActionInfo>& action_table();

}  // namespace gpipe::detail
