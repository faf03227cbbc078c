// ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024):
// zero bubble on a V. Lane r holds stage r (its "down" stage) and stage
// 2n - 1 - r (its "up" stage), so a micro-batch goes down the lanes and
// back up, and its loss and first backward are on lane 0, where it began.
// Backwards are split into their input part (B) and weight part (W).
//
// Lane r runs, with F, B and W of one cost in mind:
// - warm-up: 2 (n - r) - 1 down forwards; then r times an up forward and a
//   down forward; then n - r times an up forward with its B and W at once;
// - steady: down F, down B, down W, up F, up B, up W, until every forward
//   has run;
// - cool-down: r times a down B and an up B (Ws wait, they fill the drain),
//   then n - r times a down B and a down W; then what is left: Bs, then the
//   deferred up Ws and down Ws.
// Each action is taken only when it may run (a forward for a micro-batch
// that exists, a B after its forward, a down B after the up B of its
// micro-batch, a W after its B), so the order holds for any number of
// micro-batches; with m >= 2n the bubble per lane is (n - 1) F, a sixth of
// 1F1B's at equal costs, and each lane holds at most 2n micro-batches of
// half a lane's layers: 1F1B's peak.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include "schedule/plan_builders.h"

namespace gpipe::detail {

namespace {

class VLane {
 public:
  VLane(int64_t m, int64_t n, int64_t r)
      : m_(m), down_(r), up_(2 * n - 1 - r) {}

  void down_forward() {
    take(f_down_, f_down_ < m_, down_, Phase::Forward);
  }
  void up_forward() {
    take(f_up_, f_up_ < std::min(m_, f_down_), up_, Phase::Forward);
  }
  void down_input() {
    // The down stage's B needs the up stage's B of the same micro-batch
    // (it runs further along the V) and its own forward.
    take(
        b_down_,
        b_down_ < std::min(f_down_, b_up_),
        down_,
        Phase::BackwardInput);
  }
  void up_input() {
    take(b_up_, b_up_ < f_up_, up_, Phase::BackwardInput);
  }
  void down_weight() {
    take(w_down_, w_down_ < b_down_, down_, Phase::BackwardWeight);
  }
  void up_weight() {
    take(w_up_, w_up_ < b_up_, up_, Phase::BackwardWeight);
  }

  bool forwards_left() const {
    return f_down_ < m_ || f_up_ < f_down_;
  }
  bool inputs_left() const {
    return b_down_ < m_ || b_up_ < m_;
  }
  size_t size() const {
    return cells_.size();
  }
  std::vector<Cell> take_cells() {
    return std::move(cells_);
  }

 private:
  void take(int64_t& count, bool may, int64_t stage, Phase phase) {
    if (may) {
      cells_.push_back(Cell{count++, stage, phase});
    }
  }

  int64_t m_;
  int64_t down_;
  int64_t up_;
  int64_t f_down_ = 0, f_up_ = 0;
  int64_t b_down_ = 0, b_up_ = 0;
  int64_t w_down_ = 0, w_up_ = 0;
  std::vector<Cell> cells_;
};

std::vector<Cell> v_lane(int64_t m, int64_t n, int64_t r) {
  VLane lane(m, n, r);
  for (int64_t k = 0; k < 2 * (n - r) - 1; ++k) {
    lane.down_forward();
  }
  for (int64_t k = 0; k < r; ++k) {
    lane.up_forward();
    lane.down_forward();
  }
  for (int64_t k = 0; k < n - r; ++k) {
    lane.up_forward();
    lane.up_input();
    lane.up_weight();
  }
  while (lane.forwards_left()) {
    const auto before = lane.size();
    lane.down_forward();
    lane.down_input();
    lane.down_weight();
    lane.up_forward();
    lane.up_input();
    lane.up_weight();
    if (lane.size() == before) {
      break;  // cannot happen: the up forwards follow the down ones
    }
  }
  for (int64_t k = 0; k < r; ++k) {
    lane.down_input();
    lane.up_input();
  }
  for (int64_t k = 0; k < n - r; ++k) {
    lane.down_input();
    lane.down_weight();
  }
  while (lane.inputs_left()) {
    const auto before = lane.size();
    lane.up_input();
    lane.down_input();
    if (lane.size() == before) {
      break;
    }
  }
  for (auto more = true; more;) {
    const auto before = lane.size();
    lane.up_weight();
    more = lane.size() != before;
  }
  for (auto more = true; more;) {
    const auto before = lane.size();
    lane.down_weight();
    more = lane.size() != before;
  }
  return lane.take_cells();
}

}  // namespace

std::vector<std::vector<Cell>> zero_bubble_v_rows(
    int64_t m, const Placement& p) {
  TORCH_CHECK_VALUE(
      p.is_v_shape(),
      "schedule: zero_bubble_v runs on Placement::v_shape (stage j and "
      "2 lanes - 1 - j on lane j), but the placement is ",
      to_string(p));
  const auto n = p.lanes();
  check_sizes(m, n);
  std::vector<std::vector<Cell>> rows;
  for (int64_t r = 0; r < n; ++r) {
    rows.push_back(v_lane(m, n, r));
  }
  return rows;
}

Placement zero_bubble_v_placement(int64_t lanes, int64_t stages_per_lane) {
  TORCH_CHECK_VALUE(
      stages_per_lane == 0 || stages_per_lane == 2,
      "schedule: zero_bubble_v runs 2 stages on each lane "
      "(Placement::v_shape), but got stages_per_lane ",
      stages_per_lane);
  return Placement::v_shape(lanes);
}

}  // namespace gpipe::detail
