#pragma once

// Plans: a schedule written out as data. For each lane (a worker thread, or
// later a process), the ordered cells it runs: forward or backward of one
// micro-batch on one stage. Forward passes, autograd's backward and
// train_step all run plans, and a schedule (fill-drain, 1F1B) is a function
// that builds one. Plans are pure data: no tensors, no threads.

#include <gpipe/schedule.h>

#include <cstdint>
#include <iosfwd>
#include <vector>

namespace gpipe {

/// The ordered cells of every lane.
///
/// A stage (partition) belongs to exactly one lane; a lane may hold several
/// stages (as interleaved schedules put several on one device). Each lane
/// runs its cells one after the other; a cell waits for its inputs: the
/// forward of micro-batch i on stage j for the forward of (i, j-1), the
/// backward of (i, j) for the backward of (i, j+1) and for its own forward.
struct Plan {
  int64_t micro_batches = 0;
  int64_t stages = 0;
  /// lanes[l]: the cells lane l runs, in order.
  std::vector<std::vector<Cell>> lanes;

  /// Throws `c10::ValueError` naming the first problem: a cell outside
  /// (micro_batches, stages), a cell listed twice, a stage on two lanes,
  /// forwards or backwards present for some cells but not all, or a cell
  /// whose inputs can never be ready (the lanes would deadlock).
  void validate() const;

  /// The lane that runs `stage`'s cells, or -1 when none does.
  int64_t lane_of(int64_t stage) const;

  /// Unit-time simulation: every cell takes one step and starts at the
  /// first step after its lane's previous cell and its inputs. Shows where
  /// the bubbles are. Throws like `validate()` when the plan deadlocks.
  Steps steps() const;
};

/// One lane per stage, forwards only, in GPipe's clock-cycle order.
Plan forward_plan(int64_t micro_batches, int64_t stages);

/// One lane per stage, backwards only, fill-drain's reversed clock cycles.
Plan backward_plan(int64_t micro_batches, int64_t stages);

/// One lane per stage, forwards and backwards of a training step in the
/// order `schedule` gives.
Plan training_plan(Schedule schedule, int64_t micro_batches, int64_t stages);

/// A table of lanes by time step (the unit-time simulation), e.g.
/// ```
/// lane 0 | F0 F1 .  .  B1 B0
/// lane 1 | .  F0 F1 B1 B0 .
/// ```
/// (with the stage after the letter when a lane holds several stages).
std::ostream& operator<<(std::ostream& out, const Plan& plan);

}  // namespace gpipe
