#include <gpipe/schedule.h>

#include <algorithm>
#include <stdexcept>

namespace gpipe {

namespace {

void check_sizes(int64_t micro_batches, int64_t partitions) {
  // Callers validate user input first; this guards the pure function itself.
  if (micro_batches < 0 || partitions < 0) {
    throw std::invalid_argument(
        "schedule: micro_batches and partitions must be non-negative, but "
        "got " +
        std::to_string(micro_batches) + " and " + std::to_string(partitions));
  }
}

}  // namespace

Steps clock_cycles(int64_t m, int64_t n) {
  check_sizes(m, n);
  Steps steps;
  if (m == 0 || n == 0) {
    return steps;
  }
  for (int64_t k = 0; k < m + n - 1; ++k) {
    std::vector<Cell> step;
    for (int64_t j = std::max<int64_t>(1 + k - m, 0);
         j < std::min<int64_t>(1 + k, n);
         ++j) {
      step.push_back(Cell{k - j, j, Phase::Forward});
    }
    steps.push_back(std::move(step));
  }
  return steps;
}

Steps reverse_clock_cycles(int64_t m, int64_t n) {
  Steps steps = clock_cycles(m, n);
  std::reverse(steps.begin(), steps.end());
  for (auto& step : steps) {
    std::reverse(step.begin(), step.end());
    for (auto& cell : step) {
      cell.phase = Phase::Backward;
    }
  }
  return steps;
}

std::vector<Cell> cells_of_partition(const Steps& steps, int64_t partition) {
  std::vector<Cell> cells;
  for (const auto& step : steps) {
    for (const auto& cell : step) {
      if (cell.partition == partition) {
        cells.push_back(cell);
      }
    }
  }
  return cells;
}

std::string to_string(const Cell& cell) {
  return std::string(cell.phase == Phase::Forward ? "F(" : "B(") +
         std::to_string(cell.micro_batch) + "," +
         std::to_string(cell.partition) + ")";
}

}  // namespace gpipe
