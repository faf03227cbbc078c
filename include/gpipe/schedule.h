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

}  // namespace gpipe
