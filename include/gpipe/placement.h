#pragma once

// Placement: which lane (a worker thread, or in gpipe::dist a pipeline rank)
// runs each stage. Pure data beside Plan: the engine, PipelineStage, the
// transports, make_plan and the planner read a stage's lane from here and
// nowhere else.

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace gpipe {

/// The lane of each stage. Lanes are numbered 0 .. lanes() - 1 and every
/// lane holds at least one stage; a lane may hold several, adjacent or not.
///
/// ```
/// Placement::modulo(4)        // stage j on lane j (today's default)
/// Placement::modulo(2, 2)     // stages 0 1 2 3 on lanes 0 1 0 1
/// Placement::v_shape(2)       // stages 0 1 2 3 on lanes 0 1 1 0
/// Placement({0, 0, 1, 1})     // any list
/// ```
class Placement {
 public:
  /// No placement: a plan without one takes each stage's lane from the row
  /// that lists its cells.
  Placement() = default;
  /// `lane_of_stage[j]` is stage j's lane. Throws `c10::ValueError` for a
  /// negative lane, a lane below the largest that holds no stage, or more
  /// than 2^20 stages.
  explicit Placement(std::vector<int64_t> lane_of_stage);

  /// Stage j on lane j % lanes, `lanes * stages_per_lane` stages: the
  /// default, and what interleaved schedules need.
  static Placement modulo(int64_t lanes, int64_t stages_per_lane = 1);
  /// Two stages per lane in a V: stage j and stage 2 lanes - 1 - j on lane
  /// j, so that the first and the last stage share lane 0 (ZB-V's
  /// placement, `Schedule::ZeroBubbleV`).
  static Placement v_shape(int64_t lanes);

  bool empty() const {
    return lane_of_stage_.empty();
  }
  int64_t stages() const {
    return static_cast<int64_t>(lane_of_stage_.size());
  }
  int64_t lanes() const {
    return lanes_;
  }
  /// Stage `stage`'s lane; throws `c10::IndexError` outside [0, stages()).
  int64_t lane_of(int64_t stage) const;
  /// The stages on `lane`, in increasing order; throws `c10::IndexError`
  /// outside [0, lanes()).
  std::vector<int64_t> stages_of(int64_t lane) const;
  const std::vector<int64_t>& lane_of_stage() const {
    return lane_of_stage_;
  }
  /// True when it is `modulo(lanes(), stages() / lanes())`.
  bool is_modulo() const;
  /// True when it is `v_shape(lanes())`.
  bool is_v_shape() const;

  bool operator==(const Placement& other) const {
    return lane_of_stage_ == other.lane_of_stage_;
  }
  bool operator!=(const Placement& other) const {
    return !(*this == other);
  }

 private:
  std::vector<int64_t> lane_of_stage_;
  int64_t lanes_ = 0;
};

/// "modulo(2 lanes, 2 stages per lane)", "v_shape(2 lanes)", or the list
/// "[0, 0, 1, 1]"; "none" when empty.
std::string to_string(const Placement& placement);
std::ostream& operator<<(std::ostream& out, const Placement& placement);

/// The one check of a placement against what runs it: `stages` stages, and
/// `lanes` lanes (-1: any number; below it is refused). Throws
/// `c10::ValueError` naming both when they differ, or when the placement
/// is empty for stages > 0; `who` starts the message ("gpipe::GPipe",
/// "train_step").
void verify_placement(
    const Placement& placement,
    int64_t stages,
    int64_t lanes = -1,
    const std::string& who = "placement");

}  // namespace gpipe
