#pragma once

// The order in which pipeline cells run. Pure functions over (micro-batches,
// partitions): no tensors, no threads, so the schedule can be read and tested
// on its own.

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// What a cell does.
enum class Phase { Forward, Backward };

/// One unit of pipeline work: micro-batch `micro_batch` through partition
/// `partition`, in one direction.
struct Cell {
  int64_t micro_batch = 0;
  int64_t partition = 0;
  Phase phase = Phase::Forward;

  bool operator==(const Cell& other) const {
    return micro_batch == other.micro_batch && partition == other.partition &&
           phase == other.phase;
  }
};

/// A schedule: steps in order; the cells of one step may run at the same time.
using Steps = std::vector<std::vector<Cell>>;

/// GPipe's forward clock cycles: `m + n - 1` steps, step `k` holds the cells
/// `(k - j, j)` for every partition `j` with `0 <= k - j < m`.
/// Example (m=3, n=3): [(0,0)] [(1,0),(0,1)] [(2,0),(1,1),(0,2)] [(2,1),(1,2)]
/// [(2,2)].
Steps clock_cycles(int64_t micro_batches, int64_t partitions);

/// Fill-drain backward: the forward clock cycles in reverse, every cell in
/// reverse order, with `Phase::Backward`. Partition `j` sees micro-batches
/// `m-1, ..., 0`.
Steps reverse_clock_cycles(int64_t micro_batches, int64_t partitions);

/// The cells of one partition in the order the steps give them. A lane runs
/// exactly this list, one cell after the other.
std::vector<Cell> cells_of_partition(const Steps& steps, int64_t partition);

/// "F(0,1)" / "B(2,0)": for messages and test output.
std::string to_string(const Cell& cell);

/// The order of forward and backward cells in a training step.
enum class Schedule {
  /// GPipe: every forward (clock cycles), then every backward (reversed).
  /// Partition j holds all m micro-batches' activations when backward
  /// starts.
  FillDrain,
  /// PipeDream-flush: partition j runs n - j - 1 forwards, then alternates
  /// one forward and one backward, then drains the backwards. It holds at
  /// most n - j micro-batches in flight; the bubble is the same.
  OneFOneB,
};

/// "fill_drain" / "1f1b".
std::string to_string(Schedule schedule);
/// Parses "fill_drain" / "1f1b"; throws std::invalid_argument otherwise.
Schedule schedule_from_string(const std::string& name);

/// The cells partition `partition` runs in a training step under
/// `schedule`, in order. A lane runs exactly this list.
std::vector<Cell> lane_order(
    Schedule schedule,
    int64_t micro_batches,
    int64_t partitions,
    int64_t partition);

/// A whole training step as steps of unit-time cells: each lane runs its
/// `lane_order` and a cell starts at the first step after the cells it
/// depends on (the same micro-batch on the previous partition in forward,
/// on the next partition and its own forward in backward). Shows where the
/// bubbles are; `cells_of_partition` of the result is `lane_order`.
Steps training_steps(
    Schedule schedule, int64_t micro_batches, int64_t partitions);

/// The most micro-batches partition `partition` holds between their
/// forward and their backward when it runs `cells` (its lane order).
int64_t max_in_flight(const std::vector<Cell>& cells);

}  // namespace gpipe
