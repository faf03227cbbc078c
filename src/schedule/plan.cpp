// Plans as data: the unit-time simulation, printing, and the training plan
// of a schedule (validation is plan_validate.cpp's).

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <tuple>

#include "schedule/actions.h"
#include "schedule/plan_builders.h"
#include "text.h"

namespace gpipe {

namespace detail {

void check_sizes(int64_t m, int64_t n) {
  TORCH_CHECK_VALUE(
      m >= 0 && n >= 0,
      "schedule: micro_batches and partitions must be non-negative, but got ",
      m,
      " and ",
      n);
  // A plan holds a few cells per (micro-batch, stage) pair: past this it
  // would need gigabytes, and asking for them ended in std::bad_alloc (or
  // the OOM killer) rather than an error that says why.
  TORCH_CHECK_VALUE(
      n == 0 || m <= kMaxPlanPairs / n,
      "schedule: expected at most ",
      kMaxPlanPairs,
      " (micro-batch, stage) pairs in a plan, but got ",
      m,
      " micro-batches on ",
      n,
      " stages");
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

using detail::CellKey;
using detail::key_of;
using detail::PlanShape;

namespace {

PlanShape shape_of(const Plan& plan) {
  PlanShape s;
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    for (const auto& c : plan.lanes[l]) {
      s.lane.emplace(c.partition, l);
      s.forward = s.forward || c.phase == Phase::Forward;
      s.loss = s.loss || c.phase == Phase::Loss;
      s.transfers = s.transfers || is_transfer(c.phase);
      if (c.phase == Phase::BackwardInput) {
        s.split.insert({c.micro_batch, c.partition});
      }
    }
  }
  return s;
}

// The cell `c` waits for, or (micro_batch -1) when none is left: the first
// of its inputs (its action's `waits_for`) that has not finished.
template <typename Finished>
Cell missing_input(
    const Cell& c, int64_t n, const PlanShape& s, const Finished& finished) {
  for (const auto& d : detail::action_info(c.phase).waits_for(c, n, s)) {
    if (!finished(d)) {
      return d;
    }
  }
  return Cell{-1, -1, Phase::Forward};
}

}  // namespace

namespace detail {

CellInputs::CellInputs(const Plan& plan)
    : stages_(plan.stages),
      shape_(std::make_shared<PlanShape>(shape_of(plan))) {}

std::vector<Cell> CellInputs::of(const Cell& c) const {
  std::vector<Cell> inputs;
  std::set<CellKey> taken;
  for (;;) {
    const auto missing = missing_input(c, stages_, *shape_, [&](const Cell& d) {
      return taken.count(key_of(d)) > 0;
    });
    if (missing.micro_batch < 0) {
      return inputs;
    }
    taken.insert(key_of(missing));
    inputs.push_back(missing);
  }
}

}  // namespace detail

int64_t Plan::lane_of(int64_t stage) const {
  if (!placement.empty()) {
    return stage >= 0 && stage < placement.stages() ? placement.lane_of(stage)
                                                    : -1;
  }
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
  const auto d = shape_of(*this);
  size_t remaining = 0;
  for (const auto& lane : lanes) {
    remaining += lane.size();
  }
  std::map<CellKey, int64_t> done;  // cell -> the step it ran in
  std::vector<size_t> next(lanes.size(), 0);
  Steps steps;
  std::vector<Cell> leading;  // instants before step 0
  auto instant = [](const Cell& c) {
    return !detail::action_info(c.phase).step;
  };
  // Only the lanes whose next cell may have become ready are looked at
  // (awake, in lane order, as a scan of every lane would meet them); a
  // lane whose next cell waits sleeps until what it waits for finishes.
  // Scanning every lane every step made a plan of many lanes cost lanes
  // squared times micro-batches (0.5 s at 2,048 lanes).
  std::set<size_t> awake;
  for (size_t l = 0; l < lanes.size(); ++l) {
    if (!lanes[l].empty()) {
      awake.insert(l);
    }
  }
  std::map<CellKey, std::vector<size_t>> sleeping;  // by what they wait for
  auto wake = [&](const Cell& c) {
    const auto it = sleeping.find(key_of(c));
    if (it != sleeping.end()) {
      awake.insert(it->second.begin(), it->second.end());
      sleeping.erase(it);
    }
  };
  std::vector<Cell> last_step;  // finished from the next step on
  for (int64_t t = 0; remaining > 0; ++t) {
    auto finished = [&](const Cell& c) {
      auto it = done.find(key_of(c));
      return it != done.end() && it->second < t;
    };
    for (const auto& c : last_step) {
      wake(c);
    }
    last_step.clear();
    // The next cell of awake lane `l` waits for an input: the lane sleeps.
    auto sleeps = [&](size_t l) {
      const auto waits = missing_input(lanes[l][next[l]], stages, d, finished);
      if (waits.micro_batch < 0) {
        return false;
      }
      sleeping[key_of(waits)].push_back(l);
      return true;
    };
    // Losses and transfers take no step: one whose inputs are done by the
    // end of step t - 1 is done then too, and listed there after the step's
    // cells (before step 0's cells when it waits for nothing).
    for (bool progress = true; progress;) {
      progress = false;
      for (auto it = awake.begin(); it != awake.end();) {
        const size_t l = *it;
        bool asleep = false;
        while (next[l] < lanes[l].size() && instant(lanes[l][next[l]])) {
          if (sleeps(l)) {
            asleep = true;
            break;
          }
          const auto& c = lanes[l][next[l]++];
          done[key_of(c)] = t - 1;
          (t == 0 ? leading : steps.back()).push_back(c);
          --remaining;
          progress = true;
          wake(c);  // (a lane after this one is met in this pass)
        }
        it = asleep || next[l] == lanes[l].size() ? awake.erase(it)
                                                  : std::next(it);
      }
    }
    if (remaining == 0) {
      break;
    }
    std::vector<Cell> step;
    std::vector<size_t> rows;  // the row of each of step's cells
    for (auto it = awake.begin(); it != awake.end();) {
      const size_t l = *it;
      if (sleeps(l)) {
        it = awake.erase(it);
        continue;
      }
      step.push_back(lanes[l][next[l]]);
      rows.push_back(l);
      ++it;
    }
    if (step.empty()) {
      // Every waiting lane is stuck; name one that waits for an action
      // listed later on its own lane if there is one (the likely mistake).
      auto own = [&](size_t l) {
        const auto waits =
            missing_input(lanes[l][next[l]], stages, d, finished);
        auto it = d.lane.find(waits.partition);
        return it != d.lane.end() && it->second == l;
      };
      for (const bool first_pass : {true, false}) {
        for (size_t l = 0; l < lanes.size(); ++l) {
          if (next[l] >= lanes[l].size() || (first_pass && !own(l))) {
            continue;
          }
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
    for (size_t k = 0; k < step.size(); ++k) {
      done[key_of(step[k])] = t;
      if (++next[rows[k]] == lanes[rows[k]].size()) {
        awake.erase(rows[k]);
      }
      --remaining;
    }
    last_step = step;
    steps.push_back(std::move(step));
  }
  if (!leading.empty()) {
    if (steps.empty()) {
      steps.emplace_back();
    }
    steps[0].insert(steps[0].begin(), leading.begin(), leading.end());
  }
  return steps;
}

std::ostream& operator<<(std::ostream& out, const Plan& plan) {
  const auto steps = plan.steps();
  // By the rows that list the cells (steps() ran them so).
  std::vector<std::set<int64_t>> stages_of(plan.lanes.size());
  std::map<int64_t, size_t> row_of;
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    for (const auto& c : plan.lanes[l]) {
      stages_of[l].insert(c.partition);
      row_of.emplace(c.partition, l);
    }
  }
  auto label = [&](const Cell& c) {
    const auto l = row_of.at(c.partition);
    std::string s = stages_of[l].size() > 1 ? std::to_string(c.partition) : "";
    return s + detail::action_info(c.phase).letter +
           std::to_string(c.micro_batch);
  };
  size_t width = 1;
  auto shown = [](const Cell& c) { return detail::action_info(c.phase).step; };
  for (const auto& step : steps) {
    for (const auto& c : step) {
      width = shown(c) ? std::max(width, label(c).size()) : width;
    }
  }
  // Each step's shown cell of each lane, found once (looking through every
  // step's cells for every lane took a second for a thousand lanes).
  std::vector<std::vector<const Cell*>> grid(
      plan.lanes.size(), std::vector<const Cell*>(steps.size(), nullptr));
  for (size_t k = 0; k < steps.size(); ++k) {
    for (const auto& c : steps[k]) {
      if (shown(c)) {
        grid[row_of.at(c.partition)][k] = &c;
      }
    }
  }
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    std::ostringstream row;
    row << "lane " << l << " |";
    for (size_t k = 0; k < steps.size(); ++k) {
      const std::string cell = grid[l][k] ? label(*grid[l][k]) : ".";
      row << ' ' << cell << std::string(width - cell.size(), ' ');
    }
    auto text = row.str();
    text.erase(text.find_last_not_of(' ') + 1);
    out << text << '\n';
  }
  return out;
}

Plan training_plan(Schedule schedule, int64_t m, int64_t n) {
  detail::check_sizes(m, n);
  Plan plan;
  plan.micro_batches = m;
  plan.stages = n;
  if (n > 0) {
    // One stage per lane, stage j on lane j: lane_order's rows, made once.
    // The placement says so also where no row shows it (0 micro-batches),
    // so that to_csv writes it.
    plan.placement = Placement::modulo(n);
    plan.lanes = detail::schedule_entry(schedule).rows(m, plan.placement);
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

}  // namespace gpipe
