// gpipe-bench --only conv: a conv model through 2 lanes at chunks 1 and 4
// against the plain model, with the minor page faults of a step (Note
// [Lanes and glibc's malloc] in src/engine/lane.cpp; run it with
// GPIPE_MALLOC=system to see the lanes without that setting), on one thread
// per lane and with the lanes sharing the cores by the plan (Note [Threads
// that follow the plan] in src/engine/lane_threads.cpp) against the plain
// model at its best thread count.

#include <gpipe/gpipe.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

int64_t minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

torch::nn::Sequential conv_model() {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int k = 0; k < 8; ++k) {
    net->push_back(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).padding(1)));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

}  // namespace

nlohmann::json conv_section(int iters) {
  using nlohmann::json;
  at::set_num_threads(1);
  auto x = torch::randn({64, 32, 32, 32});
  const char* choice = std::getenv("GPIPE_MALLOC");
  std::printf(
      "\n# conv: 8 x (Conv2d(32,32,3,padding 1)+ReLU), batch 64, 32x32, "
      "training step, checkpoint never; malloc: %s\n",
      choice != nullptr ? choice : "as gpipe sets it (GPIPE_MALLOC unset)");
  auto plain = conv_model();
  // The GPipes first: their lanes set malloc up for the whole process,
  // the plain model included, so every row runs with the same malloc.
  const int cores =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::vector<std::pair<std::string, GPipe>> piped;
  for (const int64_t threads : {int64_t{1}, int64_t{0}}) {
    for (int64_t chunks : {1, 4}) {
      piped.emplace_back(
          "gpipe [8,8] chunks " + std::to_string(chunks) +
              (threads == 0 ? ", shared" : ""),
          GPipe(
              conv_model(),
              GPipeOptions({8, 8})
                  .chunks(chunks)
                  .checkpoint(Checkpoint::Never)
                  .threads_per_lane(threads)));
    }
  }
  std::vector<std::pair<std::string, std::function<void()>>> steps;
  steps.emplace_back("plain, 1 thread", [&] {
    at::set_num_threads(1);
    plain->zero_grad();
    plain->forward(x).sum().backward();
  });
  const std::string plain_all = "plain, " + std::to_string(cores) + " threads";
  if (cores > 1) {
    steps.emplace_back(plain_all, [&] {
      at::set_num_threads(cores);
      plain->zero_grad();
      plain->forward(x).sum().backward();
      at::set_num_threads(1);
    });
  }
  for (auto& [name, model] : piped) {
    steps.emplace_back(name, [&model = model, &x] {
      model->zero_grad();
      model->forward(x).sum().backward();
    });
  }
  // Rounds in alternation, so that the machine's noise falls on every row.
  std::vector<std::vector<double>> seconds(steps.size());
  std::vector<int64_t> faults(steps.size(), 0);
  for (int round = 0; round < iters + 1; ++round) {
    for (size_t k = 0; k < steps.size(); ++k) {
      const auto f0 = minor_faults();
      const auto t = time_median(steps[k].second, 0, 1);
      if (round > 0) {  // one round of warm-up
        seconds[k].push_back(t);
        faults[k] += minor_faults() - f0;
      }
    }
  }
  std::vector<double> medians;
  for (const auto& s : seconds) {
    medians.push_back(median(s));
  }
  const double plain_s = medians[0];
  const double best_plain_s =
      cores > 1 ? std::min(medians[0], medians[1]) : medians[0];
  std::printf(
      "%-30s %10s %14s %10s %15s\n",
      "config",
      "ms/step",
      "faults/step",
      "vs_plain",
      "vs_best_plain");
  json rows = json::array();
  for (size_t k = 0; k < steps.size(); ++k) {
    const double s = medians[k];
    const double f = static_cast<double>(faults[k]) / iters;
    std::printf(
        "%-30s %10.1f %14.0f %10.3f %15.3f\n",
        steps[k].first.c_str(),
        s * 1e3,
        f,
        plain_s / s,
        best_plain_s / s);
    rows.push_back(
        {{"config", steps[k].first},
         {"seconds", s},
         {"minor_faults_per_step", f},
         {"speed_vs_plain", plain_s / s},
         {"speed_vs_best_plain", best_plain_s / s}});
  }
  return {{"malloc", choice != nullptr ? choice : "gpipe"}, {"rows", rows}};
}

}  // namespace gpipe::bench
