#pragma once

// The plan builders' shared pieces (private to src/schedule/).

#include <gpipe/plan.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace gpipe::detail {

/// Throws c10::ValueError for negative sizes (callers validate user
/// input first; this guards the pure functions themselves).
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
    const std::function<bool(int64_t, int64_t, Phase)>& has);

/// Interleaved 1F1B's rows, one per lane (`lanes` lanes, `v` stages
/// each, stage j on lane j % lanes).
std::vector<std::vector<Cell>> interleaved_lanes(
    int64_t m, int64_t lanes, int64_t v);

/// ZB-V's rows, one per lane (`lanes` lanes, on Placement::v_shape).
std::vector<std::vector<Cell>> zero_bubble_v_lanes(int64_t m, int64_t lanes);

/// Looped BFS's rows, one per lane of `placement`.
std::vector<std::vector<Cell>> looped_bfs_lanes(
    int64_t m, const Placement& placement);

/// "F", "B" (whole backward or input part), "W", "L", "SEND_F", "RECV_F",
/// "SEND_B" or "RECV_B": plans' table and CSV spelling.
const char* action_letter(Phase phase);

/// The cells stage j runs in a training step, one builder per schedule.
std::vector<Cell> fill_drain_lane(int64_t m, int64_t n, int64_t j);
std::vector<Cell> one_f_one_b_lane(int64_t m, int64_t n, int64_t j);
std::vector<Cell> zero_bubble_lane(int64_t m, int64_t n, int64_t j);

}  // namespace gpipe::detail
