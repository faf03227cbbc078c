// The planner's model of a step: see step_model.h.

#include "balance/step_model.h"

#include <c10/util/irange.h>

#include <algorithm>
#include <map>

#include "engine/lane_threads.h"
#include "schedule/simulate.h"

namespace gpipe::detail {

namespace {

// A cell's key among a plan's cells.
int64_t key_of(const Cell& c, int64_t stages) {
  return (c.micro_batch * stages + c.partition) * 16 +
         static_cast<int64_t>(c.phase);
}

}  // namespace

StageCosts stage_costs(
    const LayerCosts& c, const std::vector<int64_t>& balance) {
  StageCosts s;
  size_t k = 0;
  for (const auto b : balance) {
    double f = 0, i = 0, w = 0, kept = 0, params = 0, frozen = 0;
    bool draws = false;
    const double in = c.input_bytes[k];
    for (int64_t l = 0; l < b; ++l, ++k) {
      draws = draws || c.draws_alone[k];
      f += c.forward[k];
      i += c.input[k];
      w += c.weight[k];
      kept += c.kept_bytes[k];
      params += c.param_bytes[k];
      frozen += c.frozen_bytes[k];
    }
    s.forward.push_back(f);
    s.input.push_back(i);
    s.weight.push_back(w);
    s.kept.push_back(kept);
    s.in.push_back(in);
    s.params.push_back(params);
    s.frozen.push_back(frozen);
    s.draws.push_back(draws);
  }
  return s;
}

bool checkpointed(Checkpoint mode, int64_t i, int64_t m) {
  return mode == Checkpoint::Always ||
         (mode == Checkpoint::ExceptLast && i + 1 < m);
}

Evaluated evaluate(
    const Plan& plan,
    const StageCosts& s_own,
    const LayerCosts& costs,
    Checkpoint mode,
    double overhead,
    double param_scale,
    bool cpu,
    const std::vector<std::vector<int64_t>>& cell_threads,
    const std::function<const StageCosts&(int64_t)>& at) {
  const auto m = plan.micro_batches;
  const auto cell_cost = [&](const StageCosts& s, const Cell& c) {
    const auto j = static_cast<size_t>(c.partition);
    const double recompute =
        checkpointed(mode, c.micro_batch, m) ? s.forward[j] : 0.0;
    switch (c.phase) {
      case Phase::Forward:
        return s.forward[j] + overhead;
      case Phase::Backward:
        return s.input[j] + s.weight[j] + recompute + overhead;
      case Phase::BackwardInput:
        return s.input[j] + recompute + overhead;
      case Phase::BackwardWeight:
        return s.weight[j] + overhead;
      case Phase::Loss:
        return costs.loss;
      default:
        return 0.0;
    }
  };
  // As the engine runs them: every cell at its count where every cell has
  // every core (a serial plan), else only the alone cells that take
  // kWideCellSeconds or more at the lanes' own count (Note [Wide cells on
  // the calling thread] in src/engine/wide_cells.cpp).
  int64_t most = 0;
  bool serial = true;
  for (const auto& row : cell_threads) {
    for (const auto t : row) {
      most = std::max(most, t);
    }
  }
  for (const auto& row : cell_threads) {
    for (const auto t : row) {
      serial = serial && (t == 0 || t == most);
    }
  }
  std::map<int64_t, const StageCosts*> other;  // cells at another count
  for (const auto l : c10::irange(cell_threads.size())) {
    for (const auto k : c10::irange(cell_threads[l].size())) {
      const auto& c = plan.lanes[l][k];
      if (cell_threads[l][k] > 0 &&
          (serial || cell_cost(s_own, c) >= kWideCellSeconds)) {
        other[key_of(c, plan.stages)] = &at(cell_threads[l][k]);
      }
    }
  }
  ActionCosts ac;
  ac.cost = [&](const Cell& c) {
    const auto found = other.find(key_of(c, plan.stages));
    return cell_cost(found == other.end() ? s_own : *found->second, c);
  };
  // How each cell holds the lease on the default generators (Note [Random
  // streams of concurrent cells] in src/random.h): forwards, losses and
  // recomputations hold it, shared; on CPU lanes a stage with a layer that
  // draws from the default generator itself holds it alone, so its
  // forwards (and recomputations) run one at a time. (Layers that draw
  // through the random operators draw from the cell's own generator.)
  std::function<detail::Held(const Cell&)> lease;
  // (With no such stage every holder shares it: the plain simulation.)
  if (cpu && std::find(s_own.draws.begin(), s_own.draws.end(), true) !=
                 s_own.draws.end()) {
    lease = [&](const Cell& c) {
      const auto j = static_cast<size_t>(c.partition);
      const auto how =
          s_own.draws[j] ? detail::Lease::Exclusive : detail::Lease::Shared;
      switch (c.phase) {
        case Phase::Forward:
          return detail::Held{how};
        case Phase::Loss:
          return detail::Held{detail::Lease::Shared};
        case Phase::Backward:
        case Phase::BackwardInput:
          // While it recomputes the forward.
          return checkpointed(mode, c.micro_batch, m)
                     ? detail::Held{how, s_own.forward[j]}
                     : detail::Held{};
        default:
          return detail::Held{};
      }
    };
  }
  const auto sim = detail::simulate_with_lease(plan, ac, lease);
  const auto& s = s_own;  // memory does not depend on threads
  Evaluated e;
  e.seconds = sim.makespan;
  for (const auto l : c10::irange(sim.lanes.size())) {
    double params = 0;
    for (const auto j : plan.placement.stages_of(static_cast<int64_t>(l))) {
      params += s.params[static_cast<size_t>(j)] * param_scale +
                s.frozen[static_cast<size_t>(j)];
    }
    double live = 0;
    double peak = 0;
    for (const auto& a : sim.lanes[l]) {
      const auto& c = a.cell;
      const auto j = static_cast<size_t>(c.partition);
      const bool ckpt = checkpointed(mode, c.micro_batch, m);
      switch (c.phase) {
        case Phase::Forward:
          live += ckpt ? s.in[j] : s.kept[j];
          peak = std::max(peak, live);
          break;
        case Phase::Backward:
          peak = std::max(peak, live + (ckpt ? s.kept[j] : 0.0));
          live -= ckpt ? s.in[j] : s.kept[j];
          break;
        case Phase::BackwardInput:
          // The recomputed forward stays until the weight part.
          live += ckpt ? s.kept[j] : 0.0;
          peak = std::max(peak, live);
          break;
        case Phase::BackwardWeight:
          live -= ckpt ? s.in[j] + s.kept[j] : s.kept[j];
          break;
        default:
          break;
      }
    }
    e.peaks.push_back(params + peak);
  }
  return e;
}

}  // namespace gpipe::detail
