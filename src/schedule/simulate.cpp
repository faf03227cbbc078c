// simulate: a plan run with fixed action costs, for bubbles and memory
// before anything runs.

#include "schedule/simulate.h"

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "schedule/actions.h"
#include "schedule/plan_builders.h"

namespace gpipe {

namespace {

double cost_of(const Cell& c, const ActionCosts& costs) {
  const auto& action = detail::action_info(c.phase);
  if (action.transfer) {
    return 0;  // the message's time is `costs.transfer`, on its receiver
  }
  if (costs.cost) {
    return costs.cost(c);
  }
  return action.cost == nullptr ? 0.0 : costs.*action.cost;
}

}  // namespace

namespace detail {

Simulation simulate_with_lease(
    const Plan& plan,
    const ActionCosts& costs,
    const std::function<Held(const Cell&)>& lease) {
  plan.validate();
  TORCH_CHECK_VALUE(
      costs.transfer >= 0 && std::isfinite(costs.transfer),
      "simulate: expected a finite, non-negative transfer cost, but got ",
      costs.transfer);
  const detail::CellInputs inputs(plan);
  const auto lanes = plan.lanes.size();
  Simulation sim;
  sim.busy.assign(lanes, 0.0);
  sim.lanes.resize(lanes);
  std::map<CellKey, std::pair<double, size_t>> done;  // end, lane
  std::vector<size_t> next(lanes, 0);
  std::vector<double> free(lanes, 0.0);
  size_t remaining = 0;
  for (const auto& lane : plan.lanes) {
    remaining += lane.size();
  }
  // The earliest start of lane l's next action, or -1 while an input is
  // not done (then `missing` is the first such input).
  const auto earliest = [&](size_t l, Cell& missing) {
    const auto& c = plan.lanes[l][next[l]];
    double start = free[l];
    for (const auto& d : inputs.of(c)) {
      auto it = done.find(key_of(d));
      if (it == done.end()) {
        missing = d;
        return -1.0;
      }
      const double arrives =
          it->second.first + (it->second.second == l ? 0 : costs.transfer);
      start = std::max(start, arrives);
    }
    return start;
  };
  // Lanes whose next action waits for an input, by that input; a lane's
  // next action is looked at again when it is done (only those: sweeping
  // every lane until each was done cost lanes squared times micro-batches,
  // a second at 2,048 lanes).
  std::map<CellKey, std::vector<size_t>> sleeping;
  std::vector<size_t> woken;  // by commit: lanes whose input it was
  // Actions placed so far that hold the lease: start, end, how.
  std::vector<std::tuple<double, double, Lease>> placed;
  const auto commit = [&](size_t l, double start) {
    const auto& c = plan.lanes[l][next[l]];
    const double cost = cost_of(c, costs);
    TORCH_CHECK_VALUE(
        cost >= 0 && std::isfinite(cost),
        "simulate: expected finite, non-negative costs, but ",
        to_string(c),
        " costs ",
        cost);
    const auto held = lease && cost > 0 ? lease(c) : Held{};
    const double hold = held.seconds < 0 ? cost : std::min(held.seconds, cost);
    if (held.how != Lease::None && hold > 0) {
      // An exclusive holder beside no other holder: the start moves past
      // every one it would overlap (only ever later).
      for (bool moved = true; moved;) {
        moved = false;
        for (const auto& [s, e, other] : placed) {
          if ((held.how == Lease::Exclusive || other == Lease::Exclusive) &&
              s < start + hold && start < e) {
            start = e;
            moved = true;
          }
        }
      }
      placed.emplace_back(start, start + hold, held.how);
    }
    done[key_of(c)] = {start + cost, l};
    const auto waiting = sleeping.find(key_of(c));
    if (waiting != sleeping.end()) {
      woken.insert(woken.end(), waiting->second.begin(), waiting->second.end());
      sleeping.erase(waiting);
    }
    free[l] = start + cost;
    sim.busy[l] += cost;
    sim.lanes[l].push_back(SimulatedAction{c, start, start + cost});
    ++next[l];
    --remaining;
  };
  // validate() proved the plan runs, so every action is placed. With a
  // lease each turn places the one ready action that can start first (the
  // lowest lane of those that tie), so that holders take the lease in the
  // order they would reach it; a ready action's earliest start stays as it
  // is until its lane places it. Without, every ready action in turn (the
  // earliest starts do not depend on the order).
  if (lease) {
    std::set<std::pair<double, size_t>> ready;  // earliest start, lane
    const auto look = [&](size_t l) {
      if (next[l] < plan.lanes[l].size()) {
        Cell missing;
        const double start = earliest(l, missing);
        if (start < 0) {
          sleeping[key_of(missing)].push_back(l);
        } else {
          ready.emplace(start, l);
        }
      }
    };
    for (size_t l = 0; l < lanes; ++l) {
      look(l);
    }
    while (remaining > 0) {
      TORCH_INTERNAL_ASSERT(!ready.empty());
      const auto [first, pick] = *ready.begin();
      ready.erase(ready.begin());
      commit(pick, first);
      look(pick);
      for (const auto l : std::exchange(woken, {})) {
        look(l);
      }
    }
  } else {
    std::vector<size_t> awake;
    for (size_t l = lanes; l-- > 0;) {
      awake.push_back(l);
    }
    while (!awake.empty()) {
      const auto l = awake.back();
      awake.pop_back();
      while (next[l] < plan.lanes[l].size()) {
        Cell missing;
        const double start = earliest(l, missing);
        if (start < 0) {
          sleeping[key_of(missing)].push_back(l);
          break;
        }
        commit(l, start);
      }
      awake.insert(awake.end(), woken.begin(), woken.end());
      woken.clear();
    }
    TORCH_INTERNAL_ASSERT(remaining == 0);
  }
  double first = 0;
  double last = 0;
  bool any = false;
  for (const auto& lane : sim.lanes) {
    for (const auto& a : lane) {
      first = any ? std::min(first, a.start) : a.start;
      last = any ? std::max(last, a.end) : a.end;
      any = true;
    }
  }
  sim.makespan = last - first;
  double idle = 0;
  for (const auto b : sim.busy) {
    idle += sim.makespan - b;
  }
  sim.bubble = lanes > 0 ? idle / static_cast<double>(lanes) : 0.0;
  sim.bubble_fraction = sim.makespan > 0 ? sim.bubble / sim.makespan : 0.0;

  // Activation memory: a micro-batch is live on a stage from the start of
  // its forward to the end of its (last) backward part.
  sim.peak_live.assign(static_cast<size_t>(plan.stages), 0);
  sim.lane_peak_live.assign(lanes, 0);
  for (size_t l = 0; l < lanes; ++l) {
    std::map<int64_t, int64_t> live;  // stage -> live now
    int64_t total = 0;
    for (const auto& a : sim.lanes[l]) {
      const auto& c = a.cell;
      if (c.phase == Phase::Forward) {
        auto& here = live[c.partition];
        ++here;
        ++total;
        auto& peak = sim.peak_live[static_cast<size_t>(c.partition)];
        peak = std::max(peak, here);
        sim.lane_peak_live[l] = std::max(sim.lane_peak_live[l], total);
      } else if (detail::action_info(c.phase).frees) {
        --live[c.partition];
        --total;
      }
    }
  }
  return sim;
}

}  // namespace detail

Simulation simulate(const Plan& plan, const ActionCosts& costs) {
  return detail::simulate_with_lease(plan, costs, {});
}

}  // namespace gpipe
