// Plans as data: validation, the unit-time simulation, printing, and the
// training plan of a schedule.

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

void Plan::validate() const {
  TORCH_CHECK_VALUE(
      micro_batches >= 0 && stages >= 0,
      "plan: expected non-negative micro_batches and stages, but got ",
      micro_batches,
      " and ",
      stages);
  // The pipeline's own placement is checked where a plan meets a pipeline;
  // here the plan's placement against its own stages and rows.
  TORCH_CHECK_VALUE(
      placement.empty() || placement.stages() == stages,
      "plan: its placement ",
      to_string(placement),
      " places ",
      detail::count_of(placement.stages(), "stage", "stages"),
      ", but the plan has ",
      detail::count_of(stages, "stage", "stages"));
  TORCH_CHECK_VALUE(
      placement.empty() ||
          placement.lanes() == static_cast<int64_t>(lanes.size()),
      "plan: its placement ",
      to_string(placement),
      " uses ",
      detail::count_of(placement.lanes(), "lane", "lanes"),
      ", but the plan has ",
      detail::count_of(
          static_cast<int64_t>(lanes.size()), "row (lane)", "rows (lanes)"));
  std::set<CellKey> seen;
  std::map<int64_t, size_t> stage_lane;
  size_t forwards = 0;
  size_t backwards = 0;  // whole backwards and input parts
  size_t losses = 0;
  size_t transfers = 0;
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
          detail::count_of(micro_batches, "micro-batch", "micro-batches"),
          " and ",
          detail::count_of(stages, "stage", "stages"));
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
      TORCH_CHECK_VALUE(
          placement.empty() ||
              placement.lane_of(c.partition) == static_cast<int64_t>(l),
          "plan: lane ",
          l,
          " runs ",
          to_string(c),
          ", but the plan's placement ",
          to_string(placement),
          " puts stage ",
          c.partition,
          " on lane ",
          placement.empty() ? -1 : placement.lane_of(c.partition));
      if (c.phase == Phase::Forward) {
        ++forwards;
      } else if (c.phase == Phase::Loss) {
        ++losses;
        TORCH_CHECK_VALUE(
            c.partition + 1 == stages,
            "plan: ",
            to_string(c),
            " is a loss on stage ",
            c.partition,
            ", but losses belong to the last stage, ",
            stages - 1);
      } else if (is_transfer(c.phase)) {
        ++transfers;
      } else if (c.phase != Phase::BackwardWeight) {
        ++backwards;
      }
    }
  }
  auto has = [&](int64_t i, int64_t j, Phase phase) {
    return seen.count(key_of(Cell{i, j, phase})) > 0;
  };
  // The checks below go over the (micro-batch, stage) pairs the actions
  // name, in order, and over the first pair without a forward (or without
  // a backward) when some pairs have one: a pair no action names fails only
  // those two checks, and no earlier such pair can fail them. So the work
  // follows the actions listed, not micro_batches x stages (a one-line CSV
  // may name micro-batch 999999999), and the first problem named is the
  // one a walk over every pair would meet first.
  // `seen` is in (micro-batch, stage, action) order: its distinct pairs
  // come out sorted.
  std::vector<std::pair<int64_t, int64_t>> pairs;
  pairs.reserve(seen.size());
  for (const auto& k : seen) {
    const std::pair<int64_t, int64_t> pair{std::get<0>(k), std::get<1>(k)};
    if (pairs.empty() || pairs.back() != pair) {
      pairs.push_back(pair);
    }
  }
  // The first pair without `present`, found within (pairs with it) + 1
  // steps, put in its place among the others.
  auto first_without = [&](auto present) {
    for (int64_t i = 0; i < micro_batches; ++i) {
      for (int64_t j = 0; j < stages; ++j) {
        if (!present(i, j)) {
          const std::pair<int64_t, int64_t> pair{i, j};
          const auto at = std::lower_bound(pairs.begin(), pairs.end(), pair);
          if (at == pairs.end() || *at != pair) {
            pairs.insert(at, pair);
          }
          return;
        }
      }
    }
  };
  int64_t all = 0;  // every pair; -1 when more than any count
  if (__builtin_mul_overflow(micro_batches, stages, &all)) {
    all = -1;
  }
  if (forwards > 0 && static_cast<int64_t>(forwards) != all) {
    first_without(
        [&](int64_t i, int64_t j) { return has(i, j, Phase::Forward); });
  }
  // (A pair holds one whole backward or one input part, unless it holds
  // both, which is refused below: as many as every pair means none is
  // missing, or a plan refused anyway.)
  if (backwards > 0 && static_cast<int64_t>(backwards) != all) {
    first_without([&](int64_t i, int64_t j) {
      return has(i, j, Phase::Backward) || has(i, j, Phase::BackwardInput);
    });
  }
  for (const auto& [i, j] : pairs) {
    TORCH_CHECK_VALUE(
        forwards == 0 || static_cast<int64_t>(forwards) == all ||
            has(i, j, Phase::Forward),
        "plan: ",
        to_string(Cell{i, j, Phase::Forward}),
        " is never run, although other forwards are");
    if (j + 1 == stages && losses > 0) {
      const bool forward = has(i, j, Phase::Forward);
      const bool loss = has(i, j, Phase::Loss);
      TORCH_CHECK_VALUE(
          !loss || forward,
          "plan: ",
          to_string(Cell{i, j, Phase::Loss}),
          " has no forward ",
          to_string(Cell{i, j, Phase::Forward}));
      TORCH_CHECK_VALUE(
          loss || !forward,
          "plan: the loss ",
          to_string(Cell{i, j, Phase::Loss}),
          " is never run, although other losses are; list every loss or "
          "none");
    }
    const bool whole = has(i, j, Phase::Backward);
    const bool input = has(i, j, Phase::BackwardInput);
    const bool weight = has(i, j, Phase::BackwardWeight);
    TORCH_CHECK_VALUE(
        !(whole && (input || weight)),
        "plan: micro-batch ",
        i,
        " on stage ",
        j,
        " has a whole backward ",
        to_string(Cell{i, j, Phase::Backward}),
        " and a split one; give it one or the other");
    TORCH_CHECK_VALUE(
        input == weight,
        "plan: ",
        to_string(
            Cell{i, j, input ? Phase::BackwardInput : Phase::BackwardWeight}),
        " has no ",
        input ? "weight part " : "input part ",
        to_string(
            Cell{i, j, input ? Phase::BackwardWeight : Phase::BackwardInput}),
        "; a split backward needs both");
    TORCH_CHECK_VALUE(
        backwards == 0 || whole || input,
        "plan: the backward of micro-batch ",
        i,
        " on stage ",
        j,
        " (",
        to_string(Cell{i, j, Phase::Backward}),
        ", or ",
        to_string(Cell{i, j, Phase::BackwardInput}),
        " and ",
        to_string(Cell{i, j, Phase::BackwardWeight}),
        ") is never run, although other backwards are");
  }
  if (transfers > 0) {
    detail::validate_transfers(*this, stage_lane, pairs, has);
  }
  steps();
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
