// Plan::validate: the one check of a plan, which names the first problem.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "schedule/actions.h"
#include "schedule/plan_builders.h"
#include "text.h"

namespace gpipe {

using detail::CellKey;
using detail::key_of;

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
          // (From CSV, as PyTorch 2.3 writes it, a B is one too.)
          c.phase == Phase::BackwardInput
              ? " (an input part: I, or B where the cell also has a W)"
              : "",
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

}  // namespace gpipe
