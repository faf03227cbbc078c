#pragma once

// The plan builders' shared pieces (private to src/schedule/).

#include <gpipe/plan.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

namespace gpipe::detail {

/// The most (micro-batch, stage) pairs a plan may have: 2^26, a plan of
/// about 5 GB.
constexpr int64_t kMaxPlanPairs = int64_t{1} << 26;

/// Throws c10::ValueError for negative sizes or more pairs than
/// kMaxPlanPairs (callers validate user input first; this guards the pure
/// functions themselves).
void check_sizes(int64_t micro_batches, int64_t stages);

/// One lane per stage, each running its cells in the order `steps` gives.
Plan plan_of_steps(const Steps& steps, int64_t micro_batches, int64_t stages);

/// The cells a cell of `plan` waits for (its inputs), as `validate()` and
/// the simulations read them.
struct PlanShape;
class CellInputs {
 public:
  explicit CellInputs(const Plan& plan);
  std::vector<Cell> of(const Cell& cell) const;

 private:
  int64_t stages_;
  std::shared_ptr<const PlanShape> shape_;
};

/// The one-lane-per-stage plan `flat` on `placement`'s lanes, each lane
/// running its cells in the order of `flat`'s time steps; never
/// deadlocks. The plan carries the placement.
Plan fold_onto_lanes(const Plan& flat, const Placement& placement);

/// `plan` with each micro-batch's loss right after the last stage's
/// forward.
Plan with_losses(Plan plan);

/// Throws `c10::ValueError` unless the transfers `plan` lists are exactly
/// its messages between lanes (`stage_lane`: each stage's lane; `has`:
/// whether the plan lists an action).
void validate_transfers(
    const Plan& plan,
    const std::map<int64_t, size_t>& stage_lane,
    const std::vector<std::pair<int64_t, int64_t>>& pairs,
    const std::function<bool(int64_t, int64_t, Phase)>& has);

// Note [One table of schedules]
// A schedule is its rows: a function from the micro-batches and a
// placement to each lane's compute cells (losses are added by make_plan),
// which throws c10::ValueError naming the placement it needs when given
// another, and the placement it runs on when the caller gives only lanes.
// schedules.def lists each schedule's enumerator, its name and those two
// functions; this header declares the functions from it and
// schedule_table() (schedule.cpp) lists them, which make_plan,
// placement_for, lane_order, the names, their parsing, the autotuner and
// gpipe-train all read. A new schedule is its file, its enumerator and its
// line in schedules.def.

/// A schedule's rows, one per lane of `placement`, for `m` micro-batches.
using ScheduleRows =
    std::vector<std::vector<Cell>> (*)(int64_t m, const Placement& placement);
/// Where a schedule runs on `lanes` lanes with `stages_per_lane` stages on
/// each (0: its own choice); throws c10::ValueError when it cannot.
using SchedulePlacement = Placement (*)(int64_t lanes, int64_t stages_per_lane);

struct ScheduleEntry {
  Schedule schedule;
  const char* name;
  ScheduleRows rows;
  SchedulePlacement placement;
};

/// Every schedule, in Schedule's order.
const std::vector<ScheduleEntry>& schedule_table();
/// `schedule`'s entry; throws c10::ValueError for a value not in the table.
const ScheduleEntry& schedule_entry(Schedule schedule);

/// The rows of a schedule that gives each stage's order with one lane per
/// stage (`order(m, stages, j)`), on `placement`: each lane runs its
/// stages' cells in the order of the one-lane-per-stage plan's time steps.
std::vector<std::vector<Cell>> folded_rows(
    int64_t m,
    const Placement& placement,
    std::vector<Cell> (*order)(int64_t, int64_t, int64_t));

/// `Placement::modulo(lanes, stages_per_lane)`, one stage per lane when
/// `stages_per_lane` is 0 (make_plan.cpp).
Placement one_stage_per_lane(int64_t lanes, int64_t stages_per_lane);
/// The same with two stages per lane when `stages_per_lane` is 0.
Placement two_stages_per_lane(int64_t lanes, int64_t stages_per_lane);

// Each schedule's two functions, from its line in schedules.def (the rows
// in its own file).
#define GPIPE_SCHEDULE(value, name, rows, placement)                  \
  std::vector<std::vector<Cell>> rows(int64_t m, const Placement& p); \
  Placement placement(int64_t lanes, int64_t stages_per_lane);
#include "schedule/schedules.def"
#undef GPIPE_SCHEDULE

/// The cells stage j of n runs in a training step with one lane per
/// stage, for the schedules given that way.
std::vector<Cell> fill_drain_lane(int64_t m, int64_t n, int64_t j);
std::vector<Cell> one_f_one_b_lane(int64_t m, int64_t n, int64_t j);
std::vector<Cell> zero_bubble_lane(int64_t m, int64_t n, int64_t j);

}  // namespace gpipe::detail
