// autotune: balance x schedule x micro-batches x checkpoint mode (x
// threads per lane), each simulated with per-layer costs measured on the
// model (step_model.h), the fastest that fits the memory limit per lane
// chosen.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/autotune.h>
#include <gpipe/balance.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <iomanip>
#include <limits>
#include <map>
#include <ostream>
#include <set>
#include <sstream>

#include "balance/autotune_text.h"
#include "balance/autotune_verify.h"
#include "balance/layer_costs.h"
#include "balance/step_model.h"
#include "device.h"
#include "engine/lane_threads.h"
#include "text.h"

namespace gpipe {

namespace {

using detail::evaluate;
using detail::LayerCosts;
using detail::stage_costs;
using detail::StageCosts;

// Balances worth trying for `stages` stages: by time, by memory, and by
// their normalised sum.
std::vector<std::vector<int64_t>> balances_for(
    const LayerCosts& c, int64_t stages, Checkpoint mode, double param_scale) {
  const auto n = c.size();
  std::vector<double> time(n), memory(n), both(n);
  double total_time = 0, total_memory = 0;
  for (const auto k : c10::irange(n)) {
    time[k] = c.forward[k] + c.input[k] + c.weight[k] +
              (mode == Checkpoint::Never ? 0.0 : c.forward[k]);
    memory[k] =
        c.kept_bytes[k] + c.param_bytes[k] * param_scale + c.frozen_bytes[k];
    total_time += time[k];
    total_memory += memory[k];
  }
  for (const auto k : c10::irange(n)) {
    both[k] = (total_time > 0 ? time[k] / total_time : 0.0) +
              (total_memory > 0 ? memory[k] / total_memory : 0.0);
  }
  std::set<std::vector<int64_t>> seen;
  std::vector<std::vector<int64_t>> out;
  for (const auto* costs : {&time, &memory, &both}) {
    auto b = balance_cost(*costs, stages);
    if (seen.insert(b).second) {
      out.push_back(std::move(b));
    }
  }
  return out;
}

// The first line of an error's message, for a table's cell.
std::string first_line(const std::string& text) {
  const auto line = text.substr(0, text.find('\n'));
  return line.size() > 200 ? line.substr(0, 200) + "..." : line;
}

}  // namespace

GPipeOptions Autotuned::options() const {
  return GPipeOptions(balance)
      .chunks(chunks)
      .checkpoint(checkpoint)
      .placement(placement)
      .threads_per_lane(threads_per_lane);
}

Autotuned autotune(
    torch::nn::Sequential net,
    torch::Tensor sample_input,
    torch::Tensor sample_target,
    const LossFunction& loss_fn,
    const AutotuneOptions& options) {
  detail::verify_autotune(net, sample_input, sample_target, loss_fn, options);
  const auto layers = static_cast<int64_t>(net->size());
  const auto lanes = options.lanes();
  const auto batch =
      options.batch_size() > 0 ? options.batch_size() : sample_input.size(0);
  const auto sample_rows = sample_input.size(0);
  const int64_t cores = detail::available_cores();
  const int64_t threads = options.threads_per_lane() > 0
                              ? options.threads_per_lane()
                              : std::max<int64_t>(1, cores / lanes);
  // With threads_per_lane 0, GPipe's CPU lanes share the cores by the plan
  // (Note [Threads that follow the plan] in src/engine/lane_threads.cpp):
  // a plan whose lanes never work at once runs each cell on every core. The
  // search then weighs each such plan both ways: following the plan
  // (threads_per_lane 0), and with `threads` per lane fixed, which is
  // faster where the layers are too small to gain from more threads.
  const bool share = options.threads_per_lane() == 0 && lanes > 1 &&
                     cores > threads && sample_input.is_cpu();

  // Costs per micro-batch size (the rows scatter gives the first, largest
  // micro-batch) and thread count, profiled when first needed.
  std::map<std::pair<int64_t, int64_t>, LayerCosts> profiled;
  const auto costs_at = [&](int64_t rows, int64_t t) -> const LayerCosts& {
    auto found = profiled.find({rows, t});
    if (found == profiled.end()) {
      // Beside a cell at the lanes' own count work the other lanes; beside
      // one at more threads, about cores / t lanes' cells in all.
      const auto beside =
          t == threads
              ? lanes
              : std::min<int64_t>(lanes, std::max<int64_t>(1, cores / t));
      found = profiled
                  .emplace(
                      std::make_pair(rows, t),
                      detail::profile_layer_costs(
                          net,
                          sample_input,
                          sample_target,
                          loss_fn,
                          rows,
                          options.profile_seconds(),
                          t,
                          /*busy_lanes=*/beside - 1))
                  .first;
    }
    return found->second;
  };
  Autotuned tuned;
  // A micro-batch count the model cannot be profiled at (micro-batches
  // larger than the sample, or a layer that refuses them: BatchNorm in
  // training on one row) is rejected, with why, for every schedule; the
  // first such error is thrown if no count could be profiled at all.
  // Layers refuse micro-batches too small, and memory runs out for ones too
  // large; any other error at a size larger than one that ran is the
  // model's or the loss's own (a per-sample loss, a last layer that sums
  // over the batch: both run on micro-batches of one row only), and is
  // thrown rather than hidden by choosing the size where it does not show.
  std::exception_ptr first_failure;
  bool profiled_any = false;
  int64_t smallest_ran = 0;                         // rows; 0: none ran
  std::map<int64_t, std::exception_ptr> failed_at;  // rows: not out of memory
  const auto reject_chunks = [&](Schedule schedule,
                                 const Placement& placement,
                                 int64_t m,
                                 const std::string& why) {
    AutotuneCandidate c;
    c.chunks = m;
    c.schedule = schedule;
    c.placement = placement;
    c.checkpoint = options.checkpoints().front();
    c.threads_per_lane = options.threads_per_lane();
    c.predicted_step_seconds = std::numeric_limits<double>::infinity();
    c.rejected = why;
    tuned.candidates.push_back(std::move(c));
  };
  // Each value once, in the order given.
  const auto distinct = [](auto values) {
    decltype(values) out;
    for (const auto& v : values) {
      if (std::find(out.begin(), out.end(), v) == out.end()) {
        out.push_back(v);
      }
    }
    return out;
  };
  const auto chunk_counts = distinct(options.chunks());
  const auto modes = distinct(options.checkpoints());
  // Why nothing was tried, if so: no schedule's stages fit the layers (the
  // fewest stages asked for), or no count fits the batch.
  int64_t fewest_stages = std::numeric_limits<int64_t>::max();
  bool a_schedule_fits = false;
  bool a_count_fits = false;
  for (const auto schedule : distinct(options.schedules())) {
    const auto placement = placement_for(schedule, lanes);
    const auto stages = placement.stages();
    fewest_stages = std::min(fewest_stages, stages);
    if (stages > layers) {
      continue;  // fewer layers than stages
    }
    a_schedule_fits = true;
    for (const auto m : chunk_counts) {
      if (m > batch) {
        continue;
      }
      a_count_fits = true;
      const auto rows = (batch + m - 1) / m;
      // Tensor::chunk cuts 9 rows into 3 micro-batches of 3, not 4: the
      // plan of m micro-batches would never run on this batch.
      const auto pieces = (batch + rows - 1) / rows;
      if (pieces != m) {
        reject_chunks(
            schedule,
            placement,
            m,
            "a batch of " + std::to_string(batch) + " rows cuts into " +
                std::to_string(pieces) + " micro-batches of at most " +
                std::to_string(rows) + " rows, not " + std::to_string(m));
        continue;
      }
      if (rows > sample_rows) {
        reject_chunks(
            schedule,
            placement,
            m,
            "micro-batches of " + std::to_string(rows) +
                " rows, but the sample has " + std::to_string(sample_rows));
        continue;
      }
      const LayerCosts* profiled_costs = nullptr;
      try {
        profiled_costs = &costs_at(rows, threads);
        profiled_any = true;
        smallest_ran = smallest_ran == 0 ? rows : std::min(smallest_ran, rows);
      } catch (const c10::Error& e) {
        if (!first_failure) {
          first_failure = std::current_exception();
        }
        if (dynamic_cast<const c10::OutOfMemoryError*>(&e) == nullptr) {
          failed_at.emplace(rows, std::current_exception());
        }
        reject_chunks(
            schedule,
            placement,
            m,
            "micro-batches of " + std::to_string(rows) +
                " rows do not run: " + first_line(e.what_without_backtrace()));
        continue;
      }
      const auto& costs = *profiled_costs;
      const auto plan = make_plan(schedule, m, placement);
      // (threads_per_lane, each cell's count): the plan's, and where it
      // gives some cell another count than `threads`, `threads` fixed.
      std::vector<std::pair<int64_t, std::vector<std::vector<int64_t>>>>
          variants;
      if (share) {
        auto by_plan = detail::threads_of_cells(
            plan, std::vector<bool>(static_cast<size_t>(lanes), true), cores);
        bool differs = false;
        for (const auto& row : by_plan) {
          for (const auto t : row) {
            differs = differs || (t > 0 && t != threads);
          }
        }
        variants.emplace_back(0, std::move(by_plan));
        if (differs) {
          variants.emplace_back(threads, std::vector<std::vector<int64_t>>{});
        }
      } else {
        variants.emplace_back(
            options.threads_per_lane(), std::vector<std::vector<int64_t>>{});
      }
      for (const auto mode : modes) {
        for (const auto& balance :
             balances_for(costs, stages, mode, options.param_scale())) {
          const auto s = stage_costs(costs, balance);
          std::map<int64_t, StageCosts> by_threads;
          const auto at = [&](int64_t t) -> const StageCosts& {
            auto found = by_threads.find(t);
            if (found == by_threads.end()) {
              found =
                  by_threads.emplace(t, stage_costs(costs_at(rows, t), balance))
                      .first;
            }
            return found->second;
          };
          for (const auto& [threads_option, cell_threads] : variants) {
            const auto e = evaluate(
                plan,
                s,
                costs,
                mode,
                options.cell_overhead_seconds(),
                options.param_scale(),
                sample_input.is_cpu(),
                cell_threads,
                at);
            AutotuneCandidate c;
            c.balance = balance;
            c.chunks = m;
            c.schedule = schedule;
            c.placement = placement;
            c.checkpoint = mode;
            c.threads_per_lane = threads_option;
            c.predicted_step_seconds = e.seconds;
            c.predicted_peak_bytes = e.peaks;
            const auto peak = detail::most(e.peaks);
            if (options.memory_limit() > 0 &&
                peak > static_cast<double>(options.memory_limit())) {
              const auto lane =
                  std::max_element(e.peaks.begin(), e.peaks.end()) -
                  e.peaks.begin();
              const auto [limit_text, peak_text] =
                  detail::limit_and_peak_text(options.memory_limit(), peak);
              c.rejected = "lane " + std::to_string(lane) + " peaks at " +
                           peak_text + ", over the limit of " + limit_text;
            }
            tuned.candidates.push_back(std::move(c));
          }
        }
      }
    }
  }
  if (!profiled_any && first_failure) {
    std::rethrow_exception(first_failure);
  }
  for (const auto& [rows, failure] : failed_at) {
    if (smallest_ran > 0 && rows > smallest_ran) {
      try {
        std::rethrow_exception(failure);
      } catch (c10::Error& e) {
        TORCH_RETHROW(
            e,
            "autotune: micro-batches of ",
            smallest_ran,
            " rows ran but micro-batches of ",
            rows,
            " rows do not: a model or loss that runs on small micro-batches "
            "only would train otherwise than the plain model (leave such "
            "counts out of AutotuneOptions::chunks if that is meant)");
      }
    }
  }
  TORCH_CHECK_VALUE(
      !tuned.candidates.empty() || a_schedule_fits,
      "autotune: no candidate to try: every schedule asked for needs more "
      "stages than the model's ",
      layers,
      " layers on ",
      detail::count_of(lanes, "lane", "lanes"),
      " (the fewest: ",
      fewest_stages,
      ")");
  TORCH_CHECK_VALUE(
      !tuned.candidates.empty() || a_count_fits,
      "autotune: no candidate to try: every micro-batch count asked for "
      "(AutotuneOptions::chunks) is above the batch size ",
      batch);
  TORCH_CHECK_VALUE(!tuned.candidates.empty(), "autotune: no candidate to try");
  std::stable_sort(
      tuned.candidates.begin(),
      tuned.candidates.end(),
      [](const AutotuneCandidate& a, const AutotuneCandidate& b) {
        // Faster first; of two within a microsecond (one lane's schedules,
        // alike but for the order of their sums), the one that holds less.
        // (Whole microseconds as a double: a long long overflows past
        // 9.2e12 s, which a large cell_overhead_seconds reaches.)
        const auto us = [](const AutotuneCandidate& c) {
          return std::isfinite(c.predicted_step_seconds)
                     ? std::round(c.predicted_step_seconds * 1e6)
                     : std::numeric_limits<double>::infinity();
        };
        if (us(a) != us(b)) {
          return us(a) < us(b);
        }
        return detail::most(a.predicted_peak_bytes) <
               detail::most(b.predicted_peak_bytes);
      });
  const AutotuneCandidate* best = nullptr;
  const AutotuneCandidate* smallest = nullptr;
  for (const auto& c : tuned.candidates) {
    if (best == nullptr && c.rejected.empty()) {
      best = &c;
    }
    if (c.predicted_peak_bytes.empty()) {
      continue;  // not simulated: its micro-batches do not run
    }
    if (smallest == nullptr ||
        detail::most(c.predicted_peak_bytes) <
            detail::most(smallest->predicted_peak_bytes)) {
      smallest = &c;
    }
  }
  TORCH_CHECK_VALUE(
      smallest != nullptr,
      "autotune: no candidate could be simulated: ",
      tuned.candidates.front().rejected,
      " (chunks ",
      tuned.candidates.front().chunks,
      "); try other chunks");
  const auto [limit_text, peak_text] = detail::limit_and_peak_text(
      options.memory_limit(), detail::most(smallest->predicted_peak_bytes));
  TORCH_CHECK_VALUE(
      best != nullptr,
      "autotune: no candidate fits the memory limit of ",
      limit_text,
      " per lane; the smallest peak found is ",
      peak_text,
      " (",
      to_string(smallest->schedule),
      ", chunks ",
      smallest->chunks,
      ", checkpoint ",
      to_string(smallest->checkpoint),
      ", balance ",
      detail::balance_text(smallest->balance),
      "): raise the limit, use more lanes, or try more chunks");
  tuned.balance = best->balance;
  tuned.chunks = best->chunks;
  tuned.schedule = best->schedule;
  tuned.placement = best->placement;
  tuned.checkpoint = best->checkpoint;
  tuned.threads_per_lane = best->threads_per_lane;
  tuned.predicted_step_seconds = best->predicted_step_seconds;
  tuned.predicted_peak_bytes = best->predicted_peak_bytes;
  tuned.plan = make_plan(tuned.schedule, tuned.chunks, tuned.placement);
  return tuned;
}

}  // namespace gpipe
