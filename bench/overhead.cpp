// gpipe-bench --only overhead and --only cell-cost: what the engine costs
// per cell, on layers so small that their own work hardly shows.

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "sections.h"

#if defined(__linux__)
#include <sched.h>
#endif

namespace gpipe::bench {

namespace {

// Note [Paired steps on one CPU]
// A paired figure compares a step on the calling thread (the plain model)
// with a step on a lane thread (GPipe). Left to the scheduler, the two
// threads may sit on different CPUs, and on a shared virtual machine one
// CPU can run much slower than the other for seconds at a time: whichever
// side lands there loses, and the per-cell difference swings by far more
// than the engine costs (docs/benchmark-history.md, "Paired steps on one
// CPU"). Pinned to one CPU, both steps see the same core and the same
// caches. A lane made while the pin holds inherits it; the previous mask
// comes back when the pin goes.
class OneCpu {
 public:
  OneCpu() {
#if defined(__linux__)
    pinned_ = sched_getaffinity(0, sizeof(previous_), &previous_) == 0;
    const int cpu = sched_getcpu();
    if (pinned_ && cpu >= 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pinned_ = sched_setaffinity(0, sizeof(one), &one) == 0;
    }
#endif
  }
  ~OneCpu() {
#if defined(__linux__)
    if (pinned_) {
      sched_setaffinity(0, sizeof(previous_), &previous_);
    }
#endif
  }
  OneCpu(const OneCpu&) = delete;
  OneCpu& operator=(const OneCpu&) = delete;

 private:
#if defined(__linux__)
  cpu_set_t previous_{};
#endif
  bool pinned_ = false;
};

// The plain model's training step over the micro-batches: one after the
// other (the work a one-partition GPipe step does, without the engine), or
// with `fill_drain` in GPipe's order: every forward with its graph kept,
// then every backward, the last micro-batch first.
std::function<void()> plain_training_step(
    torch::nn::Sequential net,
    std::vector<torch::Tensor> xs,
    bool fill_drain = false) {
  return [net, xs, fill_drain]() mutable {
    net->zero_grad();
    std::vector<torch::Tensor> losses;
    for (const auto& x : xs) {
      auto loss = net->forward(x).pow(2).mean();
      if (fill_drain) {
        losses.push_back(std::move(loss));
      } else {
        loss.backward();
      }
    }
    // Each graph goes as soon as its backward is done, as a cell's does.
    for (auto it = losses.rbegin(); it != losses.rend(); ++it) {
      it->backward();
      *it = torch::Tensor();
    }
  };
}

// The plain model's step as GPipe's train_step takes it: each
// micro-batch's loss weighted by its share of the batch, its backward right
// after its forward (one partition's 1F1B order).
std::function<void()> plain_weighted_step(
    torch::nn::Sequential net, std::vector<torch::Tensor> xs) {
  return [net, xs]() mutable {
    net->zero_grad();
    const double share = 1.0 / static_cast<double>(xs.size());
    for (const auto& x : xs) {
      (net->forward(x).pow(2).mean() * share).backward();
    }
  };
}

// GPipe's train_step under 1F1B, with the loss of the plain steps.
std::function<void()> gpipe_train_step(gpipe::GPipe model, torch::Tensor x) {
  const auto target = torch::zeros({x.size(0)});
  return [model, x, target]() mutable {
    model->zero_grad();
    model->train_step(
        x,
        target,
        [](torch::Tensor out, torch::Tensor) { return out.pow(2).mean(); },
        Schedule::OneFOneB);
  };
}

// GPipe's training step on the whole batch (the loss as the plain steps
// take it, on the gathered output).
std::function<void()> gpipe_training_step(gpipe::GPipe model, torch::Tensor x) {
  return [model, x]() mutable {
    model->zero_grad();
    model->forward(x).pow(2).mean().backward();
  };
}

// Per-pair differences (`times[1]` - `times[0]`, from time_rounds) over
// `cells`, in microseconds: the median and quartiles, with each step's
// median time.
nlohmann::json cost_per_cell(
    const std::vector<std::vector<double>>& times, double cells) {
  std::vector<double> per_cell;
  for (size_t k = 0; k < times[0].size(); ++k) {
    per_cell.push_back((times[1][k] - times[0][k]) / cells * 1e6);
  }
  return {
      {"plain_ms", quantile(times[0], 0.5) * 1e3},
      {"gpipe_ms", quantile(times[1], 0.5) * 1e3},
      {"us_per_cell", quantile(per_cell, 0.5)},
      {"p25_us_per_cell", quantile(per_cell, 0.25)},
      {"p75_us_per_cell", quantile(per_cell, 0.75)}};
}

void print_cost_row(const std::string& run, const nlohmann::json& row) {
  std::printf(
      "%-20s %10.3f %10.3f %12.2f %10.2f %10.2f\n",
      run.c_str(),
      row["plain_ms"].get<double>(),
      row["gpipe_ms"].get<double>(),
      row["us_per_cell"].get<double>(),
      row["p25_us_per_cell"].get<double>(),
      row["p75_us_per_cell"].get<double>());
}

}  // namespace

// Scheduling overhead: 32 tiny layers, chunks 32, against the plain model
// running the same micro-batches one after the other.
nlohmann::json overhead_section() {
  using nlohmann::json;
  at::set_num_threads(1);
  auto tiny = mlp(16, 64);
  const int64_t chunks = 32;
  auto xt = torch::randn({chunks * 4, 64});
  auto plain_step = plain_training_step(tiny, xt.chunk(chunks));
  json overhead = json::array();
  std::printf(
      "\n# per-cell overhead: 16 x (Linear(64,64)+ReLU) = 32 layers, chunks "
      "32, checkpoint never\n");
  std::printf(
      "%3s %8s %12s %12s %14s\n",
      "n",
      "cells",
      "plain_ms",
      "gpipe_ms",
      "us_per_cell");
  for (int64_t n : {1, 2}) {
    // One lane: the pair on one CPU (Note [Paired steps on one CPU]); two
    // lanes need both.
    std::optional<OneCpu> pin;
    if (n == 1) {
      pin.emplace();
    }
    gpipe::GPipe model(
        tiny,
        gpipe::GPipeOptions(
            n == 1 ? std::vector<int64_t>{32} : std::vector<int64_t>{16, 16})
            .chunks(chunks)
            .checkpoint(Checkpoint::Never)
            .threads_per_lane(1));
    const auto [t_plain, t] = gpipe::bench::time_paired(
        plain_step, gpipe_training_step(model, xt), 5, 101);
    const int64_t cells = 2 * chunks * n;
    // One lane does all the plain model's work plus the engine's: the
    // difference per cell is the overhead. With two lanes the work is
    // split, so that row shows wall time only.
    // (null in the JSON, "-" in the table).
    const double per_cell = (t - t_plain) / cells * 1e6;
    char shown[32];
    if (n == 1) {
      std::snprintf(shown, sizeof(shown), "%14.2f", per_cell);
    } else {
      std::snprintf(shown, sizeof(shown), "%14s", "-");
    }
    std::printf(
        "%3lld %8lld %12.3f %12.3f %s\n",
        (long long)n,
        (long long)cells,
        t_plain * 1e3,
        t * 1e3,
        shown);
    overhead.push_back(
        {{"partitions", n},
         {"cells", cells},
         {"plain_seconds", t_plain},
         {"gpipe_seconds", t},
         {"overhead_us_per_cell",
          n == 1 ? nlohmann::json(per_cell) : nlohmann::json(nullptr)}});
  }
  return overhead;
}

// The engine's cost per cell as issue 28 measures it: per pair of steps
// (plain, then GPipe) the difference over the 2 x chunks cells, its median
// over 101 pairs; `runs` runs and their median. Then once against the plain
// model in fill-drain order (every forward, then every backward in
// reverse), which keeps every micro-batch's activations and graph alive as
// GPipe does: what is left is the engine's own cost, without the memory
// traffic of the schedule (docs/benchmark-history.md). And once train_step
// under 1F1B against the plain model in the same order.
nlohmann::json cell_cost_section(int runs) {
  using nlohmann::json;
  constexpr int64_t kLayers = 32;
  constexpr int64_t kChunks = 32;
  constexpr int64_t kRows = 64;
  constexpr int64_t kWidth = 64;
  constexpr int kPairs = 101;
  at::set_num_threads(1);
  // Before the model makes its lane (Note [Paired steps on one CPU]).
  const OneCpu pin;
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t k = 0; k < kLayers; ++k) {
    net->push_back(torch::nn::Linear(kWidth, kWidth));
  }
  const auto x = torch::randn({kChunks * kRows, kWidth});
  const auto xs = x.chunk(kChunks);
  gpipe::GPipe model(
      net,
      gpipe::GPipeOptions({kLayers})
          .chunks(kChunks)
          .checkpoint(Checkpoint::Never)
          .threads_per_lane(1));
  const auto gpipe_step = gpipe_training_step(model, x);
  const double cells = 2.0 * kChunks;
  std::printf(
      "\n# cost per cell: 32 x Linear(64,64) in 1 partition, 32 micro-batches "
      "of 64 rows, checkpoint never, 1 thread on one CPU; per run the median "
      "over %d "
      "pairs (plain, GPipe) of the difference over %g cells\n",
      kPairs,
      cells);
  std::printf(
      "%-20s %10s %10s %12s %10s %10s\n",
      "config",
      "plain_ms",
      "gpipe_ms",
      "us_per_cell",
      "p25_us",
      "p75_us");
  json rows = json::array();
  std::vector<double> medians;
  for (int run = 1; run <= runs; ++run) {
    auto row = cost_per_cell(
        time_rounds({plain_training_step(net, xs), gpipe_step}, 5, kPairs),
        cells);
    row["config"] = "run " + std::to_string(run);
    print_cost_row(row["config"], row);
    medians.push_back(row["us_per_cell"]);
    rows.push_back(std::move(row));
  }
  auto reference = cost_per_cell(
      time_rounds(
          {plain_training_step(net, xs, /*fill_drain=*/true), gpipe_step},
          5,
          kPairs),
      cells);
  reference["config"] = "vs plain fill-drain";
  print_cost_row(reference["config"], reference);
  rows.push_back(reference);
  // train_step under 1F1B runs each micro-batch's backward after its
  // forward, as the plain steps of the runs above do: the engine's cost
  // without fill-drain's activations.
  auto one_f_one_b = cost_per_cell(
      time_rounds(
          {plain_weighted_step(net, xs), gpipe_train_step(model, x)},
          5,
          kPairs),
      cells);
  one_f_one_b["config"] = "train_step 1F1B";
  print_cost_row(one_f_one_b["config"], one_f_one_b);
  rows.push_back(one_f_one_b);
  const double median = quantile(medians, 0.5);
  const double low = *std::min_element(medians.begin(), medians.end());
  const double high = *std::max_element(medians.begin(), medians.end());
  std::printf(
      "# median of %d runs: %.2f us per cell (runs from %.2f to %.2f); "
      "against the plain model in fill-drain order: %.2f; train_step under "
      "1F1B against the plain model in its order: %.2f\n",
      runs,
      median,
      low,
      high,
      reference["us_per_cell"].get<double>(),
      one_f_one_b["us_per_cell"].get<double>());
  return {
      {"runs", rows},
      {"median_us_per_cell", median},
      {"min_us_per_cell", low},
      {"max_us_per_cell", high},
      {"us_per_cell_vs_fill_drain", reference["us_per_cell"]},
      {"us_per_cell_train_step_1f1b", one_f_one_b["us_per_cell"]}};
}

}  // namespace gpipe::bench
