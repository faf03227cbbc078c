// gpipe-bench --only autotune: the planner against a measured grid.
//
// For each model (the U-Net of the speed tables, at a smaller batch, and a
// conv-BN-ReLU CNN), on 2 lanes of one thread: autotune without a limit
// gives the fastest choice and its peak; the limit is then set below that
// peak, so that the fastest choice is ruled out, and autotune runs again
// (timed). A grid of configurations that fit the limit by the planner's
// model (the 8 it predicts fastest and every third of the rest, at least
// 12) is measured: step time (median of `iters` steps) and, per lane, the
// most it allocated above what it held before the step plus its
// parameters and gradients. The table holds each row's predicted and
// measured time and peak; the summary, the tuned choice's measured time
// against the grid's best, its prediction against its measurement,
// whether its every lane stayed under the limit, and how many grid rows
// the planner let in went over it when measured.

#include <gpipe/autotune.h>
#include <gpipe/gpipe.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

struct Case {
  std::string name;
  torch::nn::Sequential (*make)();
  torch::Tensor x;
  torch::Tensor y;
  LossFunction loss;
};

torch::nn::Sequential make_unet() {
  torch::manual_seed(0);
  return models::unet(2, 16, 3, 1);
}

torch::nn::Sequential make_cnn() {
  namespace nn = torch::nn;
  torch::manual_seed(0);
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(3, 32, 3).padding(1)),
      nn::BatchNorm2d(32),
      nn::ReLU(),
      nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)),
      nn::BatchNorm2d(64),
      nn::ReLU(),
      nn::MaxPool2d(2),
      nn::Conv2d(nn::Conv2dOptions(64, 64, 3).padding(1)),
      nn::BatchNorm2d(64),
      nn::ReLU(),
      nn::MaxPool2d(2),
      nn::Flatten(),
      nn::Linear(64 * 8 * 8, 256),
      nn::ReLU(),
      nn::Linear(256, 10));
}

struct Measured {
  double seconds = 0;
  std::vector<double> peaks;  // bytes per lane, parameters included
};

// `config`'s model, with each partition's allocations charged to its lane
// (a LaneTag first in each partition), trained with its plan.
Measured measure(
    const Case& c,
    const AutotuneCandidate& config,
    double param_scale,
    int iters) {
  auto net = c.make();
  torch::nn::Sequential tagged;
  std::vector<int64_t> balance;
  std::vector<double> params(
      static_cast<size_t>(config.placement.lanes()), 0.0);
  size_t k = 0;
  for (size_t j = 0; j < config.balance.size(); ++j) {
    const auto lane = config.placement.lane_of(static_cast<int64_t>(j));
    tagged->push_back(LaneTag(static_cast<int>(lane) + 1));
    for (int64_t l = 0; l < config.balance[j]; ++l, ++k) {
      auto layer = *(net->begin() + static_cast<int64_t>(k));
      for (const auto& p : layer.ptr()->parameters()) {
        params[static_cast<size_t>(lane)] +=
            static_cast<double>(p.numel() * p.element_size()) * param_scale;
      }
      tagged->push_back(layer);
    }
    balance.push_back(config.balance[j] + 1);
  }
  GPipe model(
      tagged,
      GPipeOptions(balance)
          .chunks(config.chunks)
          .checkpoint(config.checkpoint)
          .placement(config.placement)
          .threads_per_lane(1));
  const auto plan = make_plan(config.schedule, config.chunks, config.placement);
  // Gradients zeroed, not freed: they stay allocated between steps, so
  // that a step's allocations are its activations and transients, and the
  // gradients count once, with the parameters (param_scale).
  auto step = [&] {
    model->zero_grad(/*set_to_none=*/false);
    model->train_step(c.x, c.y, c.loss, plan);
  };
  Measured m;
  m.seconds = time_median(step, 1, iters);
  auto& counter = CountingAllocator::install();
  counter.reset_tag_peaks();
  const auto lanes = config.placement.lanes();
  std::vector<size_t> before(static_cast<size_t>(lanes));
  for (int64_t l = 0; l < lanes; ++l) {
    before[l] = counter.tag_peak(static_cast<int>(l) + 1);
  }
  step();
  for (int64_t l = 0; l < lanes; ++l) {
    m.peaks.push_back(
        static_cast<double>(
            counter.tag_peak(static_cast<int>(l) + 1) - before[l]) +
        params[static_cast<size_t>(l)]);
  }
  return m;
}

double most(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

nlohmann::json run_case(const Case& c, int iters) {
  const int64_t lanes = 2;
  const double mib = 1024.0 * 1024.0;
  auto options = AutotuneOptions(lanes).threads_per_lane(1);
  const auto free = autotune(c.make(), c.x, c.y, c.loss, options);
  const auto limit =
      static_cast<int64_t>(0.8 * most(free.predicted_peak_bytes));
  const auto begun = std::chrono::steady_clock::now();
  const auto tuned =
      autotune(c.make(), c.x, c.y, c.loss, options.memory_limit(limit));
  const double tuning =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begun)
          .count();
  std::printf(
      "\n# autotune on %s, %lld lanes of 1 thread, batch %lld: unconstrained "
      "%s\n# limit %.1f MiB per lane (0.8 of that peak); tuned in %.1f s: %s\n",
      c.name.c_str(),
      (long long)lanes,
      (long long)c.x.size(0),
      [&] {
        std::ostringstream s;
        s << free;
        return s.str();
      }()
          .c_str(),
      static_cast<double>(limit) / mib,
      tuning,
      [&] {
        std::ostringstream s;
        s << tuned;
        return s.str();
      }()
          .c_str());
  // The grid: the tuned choice, the fastest predicted, then every third.
  std::vector<const AutotuneCandidate*> grid;
  std::vector<const AutotuneCandidate*> fitting;
  for (const auto& cand : tuned.candidates) {
    if (cand.rejected.empty()) {
      fitting.push_back(&cand);
    }
  }
  for (size_t k = 0; k < fitting.size(); ++k) {
    if (k < 8 || k % 3 == 0 || grid.size() < 12) {
      grid.push_back(fitting[k]);
    }
    if (grid.size() >= 16) {
      break;
    }
  }
  std::printf(
      "%-14s %6s %-12s %-22s %9s %9s %6s %9s %9s\n",
      "schedule",
      "chunks",
      "checkpoint",
      "balance",
      "pred_ms",
      "step_ms",
      "ratio",
      "pred_MiB",
      "peak_MiB");
  nlohmann::json rows = nlohmann::json::array();
  double best = 0;
  double tuned_seconds = 0;
  bool under = true;       // the tuned choice's measured peak
  int64_t over_limit = 0;  // grid rows measured over the limit
  for (const auto* cand : grid) {
    const auto m = measure(c, *cand, options.param_scale(), iters);
    std::ostringstream balance;
    for (size_t k = 0; k < cand->balance.size(); ++k) {
      balance << (k == 0 ? "" : ",") << cand->balance[k];
    }
    const bool chosen =
        cand == &tuned.candidates.front() ||
        (cand->schedule == tuned.schedule && cand->chunks == tuned.chunks &&
         cand->checkpoint == tuned.checkpoint &&
         cand->balance == tuned.balance);
    if (chosen && tuned_seconds == 0) {
      tuned_seconds = m.seconds;
    }
    best = best == 0 ? m.seconds : std::min(best, m.seconds);
    const bool over = most(m.peaks) > static_cast<double>(limit);
    if (chosen) {
      under = !over;
    }
    over_limit += over ? 1 : 0;
    std::printf(
        "%-14s %6lld %-12s %-22s %9.1f %9.1f %6.3f %9.1f %9.1f%s\n",
        to_string(cand->schedule).c_str(),
        (long long)cand->chunks,
        to_string(cand->checkpoint).c_str(),
        balance.str().c_str(),
        cand->predicted_step_seconds * 1e3,
        m.seconds * 1e3,
        m.seconds / cand->predicted_step_seconds,
        most(cand->predicted_peak_bytes) / mib,
        most(m.peaks) / mib,
        chosen ? "  <- tuned" : "");
    rows.push_back(
        {{"schedule", to_string(cand->schedule)},
         {"chunks", cand->chunks},
         {"checkpoint", to_string(cand->checkpoint)},
         {"balance", cand->balance},
         {"predicted_seconds", cand->predicted_step_seconds},
         {"step_seconds", m.seconds},
         {"predicted_peak_mib", most(cand->predicted_peak_bytes) / mib},
         {"peak_mib", most(m.peaks) / mib},
         {"tuned", chosen}});
  }
  std::printf(
      "summary: tuned step %.1f ms, best of %zu measured %.1f ms (tuned/best "
      "%.3f); predicted %.1f ms (measured/predicted %.3f); its every lane "
      "under the limit: %s (grid rows measured over it: %lld); tuning %.1f "
      "s\n",
      tuned_seconds * 1e3,
      grid.size(),
      best * 1e3,
      tuned_seconds / best,
      tuned.predicted_step_seconds * 1e3,
      tuned_seconds / tuned.predicted_step_seconds,
      under ? "yes" : "no",
      (long long)over_limit,
      tuning);
  return {
      {"limit_mib", static_cast<double>(limit) / mib},
      {"unconstrained_peak_mib", most(free.predicted_peak_bytes) / mib},
      {"tuning_seconds", tuning},
      {"tuned_seconds", tuned_seconds},
      {"best_seconds", best},
      {"tuned_over_best", tuned_seconds / best},
      {"measured_over_predicted", tuned_seconds / tuned.predicted_step_seconds},
      {"tuned_under_limit", under},
      {"grid_rows_over_limit", over_limit},
      {"grid", rows}};
}

}  // namespace

nlohmann::json autotune_section(int iters) {
  at::set_num_threads(1);
  torch::manual_seed(0);
  std::vector<Case> cases;
  cases.push_back(
      {"U-Net(2, 16), 3x64x64",
       make_unet,
       torch::randn({32, 3, 64, 64}),
       torch::randn({32, 1, 64, 64}),
       [](torch::Tensor out, torch::Tensor t) {
         return torch::mse_loss(out, t);
       }});
  cases.push_back(
      {"CNN, 3x32x32",
       make_cnn,
       torch::randn({64, 3, 32, 32}),
       torch::randint(0, 10, {64}),
       [](torch::Tensor out, torch::Tensor t) {
         return torch::nn::functional::cross_entropy(out, t);
       }});
  // One object per model: its summary, then its grid as a table.
  nlohmann::json out = nlohmann::json::object();
  for (const auto& c : cases) {
    out[c.name] = run_case(c, iters);
  }
  return out;
}

}  // namespace gpipe::bench
