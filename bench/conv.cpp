// gpipe-bench --only conv: a conv model through 2 lanes at chunks 1 against
// the plain model, with the minor page faults of a step (Note [Lanes and
// glibc's malloc] in src/engine/lane.cpp). Run it with GPIPE_MALLOC=system
// to see the lanes without that setting.

#include <gpipe/gpipe.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

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
      "training step, one thread (per lane), checkpoint never; malloc: %s\n",
      choice != nullptr ? choice : "as gpipe sets it (GPIPE_MALLOC unset)");
  auto plain = conv_model();
  // The GPipes first: their lanes set malloc up for the whole process,
  // the plain model included, so every row runs with the same malloc.
  std::vector<std::pair<std::string, GPipe>> piped;
  for (int64_t chunks : {1, 4}) {
    piped.emplace_back(
        "gpipe [8,8] chunks " + std::to_string(chunks),
        GPipe(
            conv_model(),
            GPipeOptions({8, 8})
                .chunks(chunks)
                .checkpoint(Checkpoint::Never)
                .threads_per_lane(1)));
  }
  std::vector<std::pair<std::string, std::function<void()>>> steps;
  steps.emplace_back("plain, 1 thread", [&] {
    plain->zero_grad();
    plain->forward(x).sum().backward();
  });
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
  std::printf(
      "%-22s %10s %14s %10s\n", "config", "ms/step", "faults/step", "vs_plain");
  json rows = json::array();
  double plain_s = 0;
  for (size_t k = 0; k < steps.size(); ++k) {
    const double s = median(seconds[k]);
    plain_s = k == 0 ? s : plain_s;
    const double f = static_cast<double>(faults[k]) / iters;
    std::printf(
        "%-22s %10.1f %14.0f %10.3f\n",
        steps[k].first.c_str(),
        s * 1e3,
        f,
        plain_s / s);
    rows.push_back(
        {{"config", steps[k].first},
         {"seconds", s},
         {"minor_faults_per_step", f},
         {"speed_vs_plain", plain_s / s}});
  }
  return {{"malloc", choice != nullptr ? choice : "gpipe"}, {"rows", rows}};
}

}  // namespace gpipe::bench
