#include <gpipe/schedule.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>
#include <utility>

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

std::string to_string(Schedule schedule) {
  return schedule == Schedule::FillDrain ? "fill_drain" : "1f1b";
}

Schedule schedule_from_string(const std::string& name) {
  if (name == "fill_drain") {
    return Schedule::FillDrain;
  }
  if (name == "1f1b") {
    return Schedule::OneFOneB;
  }
  throw std::invalid_argument(
      "schedule must be 'fill_drain' or '1f1b', but got '" + name + "'");
}

std::vector<Cell> lane_order(
    Schedule schedule, int64_t m, int64_t n, int64_t j) {
  check_sizes(m, n);
  if (j < 0 || j >= n) {
    throw std::invalid_argument(
        "schedule: partition " + std::to_string(j) + " is not in [0, " +
        std::to_string(n) + ")");
  }
  std::vector<Cell> cells;
  if (schedule == Schedule::FillDrain) {
    cells = cells_of_partition(clock_cycles(m, n), j);
    auto backward = cells_of_partition(reverse_clock_cycles(m, n), j);
    cells.insert(cells.end(), backward.begin(), backward.end());
    return cells;
  }
  // 1F1B: warm up with the forwards the later partitions need before the
  // first backward can come back, then one forward, one backward.
  const int64_t warmup = std::min(n - j - 1, m);
  for (int64_t i = 0; i < warmup; ++i) {
    cells.push_back(Cell{i, j, Phase::Forward});
  }
  for (int64_t k = 0; k < m - warmup; ++k) {
    cells.push_back(Cell{warmup + k, j, Phase::Forward});
    cells.push_back(Cell{k, j, Phase::Backward});
  }
  for (int64_t i = m - warmup; i < m; ++i) {
    cells.push_back(Cell{i, j, Phase::Backward});
  }
  return cells;
}

Steps training_steps(Schedule schedule, int64_t m, int64_t n) {
  check_sizes(m, n);
  Steps steps;
  if (m == 0 || n == 0) {
    return steps;
  }
  std::vector<std::vector<Cell>> lanes;
  for (int64_t j = 0; j < n; ++j) {
    lanes.push_back(lane_order(schedule, m, n, j));
  }
  // The step each finished cell ended at.
  std::map<std::tuple<int64_t, int64_t, int>, int64_t> done;
  auto finished = [&](int64_t i, int64_t j, Phase phase, int64_t before) {
    auto it = done.find({i, j, static_cast<int>(phase)});
    return it != done.end() && it->second < before;
  };
  std::vector<size_t> next(n, 0);
  size_t remaining = static_cast<size_t>(2 * m * n);
  for (int64_t t = 0; remaining > 0; ++t) {
    std::vector<Cell> step;
    for (int64_t j = 0; j < n; ++j) {
      if (next[j] == lanes[j].size()) {
        continue;
      }
      const Cell& c = lanes[j][next[j]];
      const bool ready =
          c.phase == Phase::Forward
              ? (j == 0 || finished(c.micro_batch, j - 1, Phase::Forward, t))
              : (finished(c.micro_batch, j, Phase::Forward, t) &&
                 (j == n - 1 ||
                  finished(c.micro_batch, j + 1, Phase::Backward, t)));
      if (ready) {
        step.push_back(c);
      }
    }
    if (step.empty()) {
      throw std::logic_error("schedule: lane orders deadlock");
    }
    for (const auto& c : step) {
      done[{c.micro_batch, c.partition, static_cast<int>(c.phase)}] = t;
      ++next[c.partition];
      --remaining;
    }
    steps.push_back(std::move(step));
  }
  return steps;
}

int64_t max_in_flight(const std::vector<Cell>& cells) {
  int64_t in_flight = 0;
  int64_t most = 0;
  for (const auto& c : cells) {
    in_flight += c.phase == Phase::Forward ? 1 : -1;
    most = std::max(most, in_flight);
  }
  return most;
}

}  // namespace gpipe
