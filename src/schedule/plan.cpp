// Plans as data: validation, the unit-time simulation, printing, and the
// schedule functions of gpipe/schedule.h that read plans.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "schedule/plan_builders.h"

namespace gpipe {

namespace detail {

void check_sizes(int64_t m, int64_t n) {
  if (m < 0 || n < 0) {
    throw std::invalid_argument(
        "schedule: micro_batches and partitions must be non-negative, but "
        "got " +
        std::to_string(m) + " and " + std::to_string(n));
  }
}

Plan plan_of_steps(const Steps& steps, int64_t m, int64_t n) {
  Plan plan;
  plan.micro_batches = m;
  plan.stages = n;
  for (int64_t j = 0; j < n; ++j) {
    plan.lanes.push_back(cells_of_partition(steps, j));
  }
  return plan;
}

}  // namespace detail

namespace {

using Key = std::tuple<int64_t, int64_t, int>;

Key key_of(const Cell& c) {
  return {c.micro_batch, c.partition, static_cast<int>(c.phase)};
}

// Which directions a plan holds (validate() checks it holds all or none of
// each).
struct Directions {
  bool forward = false;
  bool backward = false;
};

Directions directions_of(const Plan& plan) {
  Directions d;
  for (const auto& lane : plan.lanes) {
    for (const auto& c : lane) {
      (c.phase == Phase::Forward ? d.forward : d.backward) = true;
    }
  }
  return d;
}

// The cell `c` waits for, or nullopt-like (micro_batch -1) when none is
// left: the first of its inputs that has not finished by `before`.
template <typename Finished>
Cell missing_input(
    const Cell& c, int64_t n, const Directions& d, const Finished& finished) {
  const auto i = c.micro_batch;
  const auto j = c.partition;
  if (c.phase == Phase::Forward) {
    if (j > 0 && !finished(Cell{i, j - 1, Phase::Forward})) {
      return Cell{i, j - 1, Phase::Forward};
    }
  } else {
    if (d.forward && !finished(Cell{i, j, Phase::Forward})) {
      return Cell{i, j, Phase::Forward};
    }
    if (j + 1 < n && !finished(Cell{i, j + 1, Phase::Backward})) {
      return Cell{i, j + 1, Phase::Backward};
    }
  }
  return Cell{-1, -1, Phase::Forward};
}

}  // namespace

int64_t Plan::lane_of(int64_t stage) const {
  for (size_t l = 0; l < lanes.size(); ++l) {
    for (const auto& c : lanes[l]) {
      if (c.partition == stage) {
        return static_cast<int64_t>(l);
      }
    }
  }
  return -1;
}

Steps Plan::steps() const {
  const auto d = directions_of(*this);
  size_t remaining = 0;
  for (const auto& lane : lanes) {
    remaining += lane.size();
  }
  std::map<Key, int64_t> done;  // cell -> the step it ran in
  std::vector<size_t> next(lanes.size(), 0);
  Steps steps;
  for (int64_t t = 0; remaining > 0; ++t) {
    auto finished = [&](const Cell& c) {
      auto it = done.find(key_of(c));
      return it != done.end() && it->second < t;
    };
    std::vector<Cell> step;
    for (size_t l = 0; l < lanes.size(); ++l) {
      if (next[l] < lanes[l].size() &&
          missing_input(lanes[l][next[l]], stages, d, finished).micro_batch <
              0) {
        step.push_back(lanes[l][next[l]]);
      }
    }
    if (step.empty()) {
      for (size_t l = 0; l < lanes.size(); ++l) {
        if (next[l] < lanes[l].size()) {
          const auto& c = lanes[l][next[l]];
          const auto waits = missing_input(c, stages, d, finished);
          TORCH_CHECK_VALUE(
              false,
              "plan deadlocks: lane ",
              l,
              " waits at ",
              to_string(c),
              " for ",
              to_string(waits),
              ", which can never run before it");
        }
      }
    }
    for (const auto& c : step) {
      done[key_of(c)] = t;
      ++next[lane_of(c.partition)];
      --remaining;
    }
    steps.push_back(std::move(step));
  }
  return steps;
}

void Plan::validate() const {
  TORCH_CHECK_VALUE(
      micro_batches >= 0 && stages >= 0,
      "plan: expected non-negative micro_batches and stages, but got ",
      micro_batches,
      " and ",
      stages);
  std::set<Key> seen;
  std::map<int64_t, size_t> stage_lane;
  size_t forwards = 0;
  size_t backwards = 0;
  for (size_t l = 0; l < lanes.size(); ++l) {
    for (const auto& c : lanes[l]) {
      TORCH_CHECK_VALUE(
          c.micro_batch >= 0 && c.micro_batch < micro_batches &&
              c.partition >= 0 && c.partition < stages,
          "plan: lane ",
          l,
          " runs ",
          to_string(c),
          ", outside ",
          micro_batches,
          " micro-batches and ",
          stages,
          " stages");
      TORCH_CHECK_VALUE(
          seen.insert(key_of(c)).second,
          "plan: ",
          to_string(c),
          " is listed twice (second time on lane ",
          l,
          ")");
      auto [it, fresh] = stage_lane.emplace(c.partition, l);
      TORCH_CHECK_VALUE(
          fresh || it->second == l,
          "plan: stage ",
          c.partition,
          " runs on lane ",
          it->second,
          " and on lane ",
          l,
          "; a stage belongs to one lane");
      (c.phase == Phase::Forward ? forwards : backwards) += 1;
    }
  }
  const auto all = static_cast<size_t>(micro_batches * stages);
  for (auto [count, phase] :
       {std::make_pair(forwards, Phase::Forward),
        std::make_pair(backwards, Phase::Backward)}) {
    if (count == 0 || count == all) {
      continue;
    }
    for (int64_t i = 0; i < micro_batches; ++i) {
      for (int64_t j = 0; j < stages; ++j) {
        const Cell c{i, j, phase};
        TORCH_CHECK_VALUE(
            seen.count(key_of(c)) > 0,
            "plan: ",
            to_string(c),
            " is never run, although other ",
            phase == Phase::Forward ? "forwards" : "backwards",
            " are");
      }
    }
  }
  steps();
}

std::ostream& operator<<(std::ostream& out, const Plan& plan) {
  const auto steps = plan.steps();
  std::vector<std::set<int64_t>> stages_of(plan.lanes.size());
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    for (const auto& c : plan.lanes[l]) {
      stages_of[l].insert(c.partition);
    }
  }
  auto label = [&](const Cell& c) {
    const auto l = static_cast<size_t>(plan.lane_of(c.partition));
    std::string s = stages_of[l].size() > 1 ? std::to_string(c.partition) : "";
    return s + (c.phase == Phase::Forward ? "F" : "B") +
           std::to_string(c.micro_batch);
  };
  size_t width = 1;
  for (const auto& step : steps) {
    for (const auto& c : step) {
      width = std::max(width, label(c).size());
    }
  }
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    std::ostringstream row;
    row << "lane " << l << " |";
    for (const auto& step : steps) {
      std::string cell = ".";
      for (const auto& c : step) {
        if (plan.lane_of(c.partition) == static_cast<int64_t>(l)) {
          cell = label(c);
        }
      }
      row << ' ' << cell << std::string(width - cell.size(), ' ');
    }
    auto text = row.str();
    text.erase(text.find_last_not_of(' ') + 1);
    out << text << '\n';
  }
  return out;
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
  detail::check_sizes(m, n);
  if (j < 0 || j >= n) {
    throw std::invalid_argument(
        "schedule: partition " + std::to_string(j) + " is not in [0, " +
        std::to_string(n) + ")");
  }
  return schedule == Schedule::FillDrain ? detail::fill_drain_lane(m, n, j)
                                         : detail::one_f_one_b_lane(m, n, j);
}

Plan training_plan(Schedule schedule, int64_t m, int64_t n) {
  detail::check_sizes(m, n);
  Plan plan;
  plan.micro_batches = m;
  plan.stages = n;
  for (int64_t j = 0; j < n; ++j) {
    plan.lanes.push_back(lane_order(schedule, m, n, j));
  }
  return plan;
}

Steps training_steps(Schedule schedule, int64_t m, int64_t n) {
  if (m == 0 || n == 0) {
    detail::check_sizes(m, n);
    return {};
  }
  return training_plan(schedule, m, n).steps();
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
