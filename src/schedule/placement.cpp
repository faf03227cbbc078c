// Placement: the lane of each stage, its standard shapes and its one check.

#include <c10/util/Exception.h>
#include <gpipe/placement.h>

#include <algorithm>
#include <ostream>
#include <sstream>

#include "text.h"

namespace gpipe {

namespace {

std::string list_of(const std::vector<int64_t>& lanes) {
  std::ostringstream out;
  out << "[";
  for (size_t j = 0; j < lanes.size(); ++j) {
    out << (j == 0 ? "" : ", ") << lanes[j];
  }
  out << "]";
  return out.str();
}

// The most stages `modulo` and `v_shape` make: far beyond any pipeline (a
// stage holds at least one layer), and far below where `lanes *
// stages_per_lane` overflows or the list stops fitting in memory.
constexpr int64_t kMaxShapedStages = int64_t{1} << 20;

}  // namespace

Placement::Placement(std::vector<int64_t> lane_of_stage)
    : lane_of_stage_(std::move(lane_of_stage)) {
  // Every placement has a name as modulo's, v_shape's or a list's, and
  // checking which (is_modulo, printing) makes the shapes of its size.
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(lane_of_stage_.size()) <= kMaxShapedStages,
      "placement: expected at most ",
      kMaxShapedStages,
      " stages, but got ",
      lane_of_stage_.size());
  std::vector<bool> used;
  for (size_t j = 0; j < lane_of_stage_.size(); ++j) {
    const auto l = lane_of_stage_[j];
    TORCH_CHECK_VALUE(
        l >= 0,
        "placement: expected a lane >= 0 for every stage, but stage ",
        j,
        " is on lane ",
        l);
    TORCH_CHECK_VALUE(
        static_cast<size_t>(l) < lane_of_stage_.size(),
        "placement: stage ",
        j,
        " is on lane ",
        l,
        ", but ",
        detail::count_of(
            static_cast<int64_t>(lane_of_stage_.size()), "stage", "stages"),
        " can fill at most lanes 0 to ",
        lane_of_stage_.size() - 1,
        "; number the lanes from 0 without gaps");
    if (static_cast<size_t>(l) >= used.size()) {
      used.resize(static_cast<size_t>(l) + 1, false);
    }
    used[static_cast<size_t>(l)] = true;
  }
  for (size_t l = 0; l < used.size(); ++l) {
    TORCH_CHECK_VALUE(
        used[l],
        "placement: lane ",
        l,
        " holds no stage, but lane ",
        used.size() - 1,
        " does; number the lanes from 0 without gaps (got ",
        list_of(lane_of_stage_),
        ")");
  }
  lanes_ = static_cast<int64_t>(used.size());
}

Placement Placement::modulo(int64_t lanes, int64_t stages_per_lane) {
  TORCH_CHECK_VALUE(
      lanes >= 1, "Placement::modulo: expected lanes >= 1, but got ", lanes);
  TORCH_CHECK_VALUE(
      stages_per_lane >= 1,
      "Placement::modulo: expected stages_per_lane >= 1, but got ",
      stages_per_lane);
  TORCH_CHECK_VALUE(
      lanes <= kMaxShapedStages / stages_per_lane,
      "Placement::modulo: expected at most ",
      kMaxShapedStages,
      " stages (lanes x stages_per_lane), but got ",
      lanes,
      " lanes x ",
      stages_per_lane);
  std::vector<int64_t> lane_of_stage;
  for (int64_t j = 0; j < lanes * stages_per_lane; ++j) {
    lane_of_stage.push_back(j % lanes);
  }
  return Placement(std::move(lane_of_stage));
}

Placement Placement::v_shape(int64_t lanes) {
  TORCH_CHECK_VALUE(
      lanes >= 1, "Placement::v_shape: expected lanes >= 1, but got ", lanes);
  TORCH_CHECK_VALUE(
      lanes <= kMaxShapedStages / 2,
      "Placement::v_shape: expected at most ",
      kMaxShapedStages / 2,
      " lanes (2 stages each), but got ",
      lanes);
  std::vector<int64_t> lane_of_stage(static_cast<size_t>(2 * lanes));
  for (int64_t j = 0; j < lanes; ++j) {
    lane_of_stage[static_cast<size_t>(j)] = j;
    lane_of_stage[static_cast<size_t>(2 * lanes - 1 - j)] = j;
  }
  return Placement(std::move(lane_of_stage));
}

int64_t Placement::lane_of(int64_t stage) const {
  TORCH_CHECK_INDEX(
      stage >= 0 && stage < stages(),
      "placement: stage ",
      stage,
      " is not in [0, ",
      stages(),
      ")");
  return lane_of_stage_[static_cast<size_t>(stage)];
}

std::vector<int64_t> Placement::stages_of(int64_t lane) const {
  TORCH_CHECK_INDEX(
      lane >= 0 && lane < lanes_,
      "placement: lane ",
      lane,
      " is not in [0, ",
      lanes_,
      ")");
  std::vector<int64_t> stages;
  for (int64_t j = 0; j < this->stages(); ++j) {
    if (lane_of_stage_[static_cast<size_t>(j)] == lane) {
      stages.push_back(j);
    }
  }
  return stages;
}

bool Placement::is_modulo() const {
  return !empty() && stages() % lanes_ == 0 &&
         *this == modulo(lanes_, stages() / lanes_);
}

bool Placement::is_v_shape() const {
  return !empty() && stages() == 2 * lanes_ && *this == v_shape(lanes_);
}

std::string to_string(const Placement& p) {
  if (p.empty()) {
    return "none";
  }
  std::ostringstream out;
  if (p.is_v_shape() && p.lanes() > 1) {
    out << "v_shape(" << detail::count_of(p.lanes(), "lane", "lanes") << ")";
  } else if (p.is_modulo()) {
    out << "modulo(" << detail::count_of(p.lanes(), "lane", "lanes") << ", "
        << detail::count_of(
               p.stages() / p.lanes(), "stage per lane", "stages per lane")
        << ")";
    // One lane's V is the same list: said, so that ZB-V on one lane does
    // not read as running on a placement it refuses.
    if (p.is_v_shape()) {
      out << " = v_shape(1 lane)";
    }
  } else {
    out << list_of(p.lane_of_stage());
  }
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Placement& placement) {
  return out << to_string(placement);
}

void verify_placement(
    const Placement& placement,
    int64_t stages,
    int64_t lanes,
    const std::string& who) {
  TORCH_CHECK_VALUE(
      lanes >= -1,
      who,
      ": expected a number of lanes >= 0 (or -1: any), but got ",
      lanes);
  TORCH_CHECK_VALUE(
      !placement.empty() || stages == 0,
      who,
      ": expected a placement of ",
      detail::count_of(stages, "stage", "stages"),
      ", but got none");
  TORCH_CHECK_VALUE(
      placement.stages() == stages,
      who,
      ": the placement ",
      to_string(placement),
      " places ",
      detail::count_of(placement.stages(), "stage", "stages"),
      ", but the pipeline has ",
      detail::count_of(stages, "stage", "stages"));
  TORCH_CHECK_VALUE(
      lanes < 0 || placement.lanes() == lanes,
      who,
      ": the placement ",
      to_string(placement),
      " uses ",
      detail::count_of(placement.lanes(), "lane", "lanes"),
      ", but the pipeline has ",
      detail::count_of(lanes, "lane", "lanes"));
}

}  // namespace gpipe
