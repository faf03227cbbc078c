// gpipe-bench --only accuracy: torchgpipe's accuracy table, scaled to 2
// cores. The small ResNet of gpipe::models trained on Fashion-MNIST as the
// plain model and through GPipe on 2 lanes (chunks 4 and 8,
// DeferredBatchNorm off and on, each checkpoint mode), the same seeds and
// hyper-parameters for all; top-1 test error over the seeds.

#include <gpipe/gpipe.h>
#include <gpipe/models/resnet.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../tools/fashion_mnist.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;

struct AccuracyConfig {
  std::string name;
  bool plain = false;
  int64_t chunks = 1;
  bool deferred_batch_norm = false;
  Checkpoint checkpoint = Checkpoint::Never;
};

struct Hyper {
  int64_t epochs;
  int64_t limit;
  int64_t batch = 128;
  double lr = 0.05;
};

// Trains one model from `seed` and returns its top-1 test error (percent).
double train_once(
    const AccuracyConfig& config,
    const std::vector<int64_t>& balance,
    const gpipe_data::FashionMnist& data,
    const Hyper& hyper,
    uint64_t seed) {
  torch::manual_seed(seed);
  auto net = models::resnet_small(10);
  GPipe model{nullptr};
  torch::nn::Module* module = net.get();
  std::function<torch::Tensor(torch::Tensor)> forward;
  if (config.plain) {
    at::set_num_threads(2);
    forward = [&net](torch::Tensor x) { return net->forward(x); };
  } else {
    at::set_num_threads(1);
    model = GPipe(
        net,
        GPipeOptions(balance)
            .chunks(config.chunks)
            .checkpoint(config.checkpoint)
            .deferred_batch_norm(config.deferred_batch_norm)
            .threads_per_lane(1));
    module = model.get();
    forward = [&model](torch::Tensor x) { return model->forward(x); };
  }
  torch::optim::SGD optimizer(
      module->parameters(), torch::optim::SGDOptions(hyper.lr).momentum(0.9));
  const auto n = std::min<int64_t>(hyper.limit, data.train_x.size(0));
  // The rate decays to 0 over the run (cosine, per step): a constant one
  // leaves the test error of so short a run varying by several points from
  // seed to seed, more than any difference the table looks for.
  const int64_t steps = hyper.epochs * (n / hyper.batch);
  int64_t step = 0;
  for (int64_t epoch = 0; epoch < hyper.epochs; ++epoch) {
    module->train();
    auto order = torch::randperm(n);
    for (int64_t begin = 0; begin + hyper.batch <= n; begin += hyper.batch) {
      auto idx = order.narrow(0, begin, hyper.batch);
      const double lr = 0.5 * hyper.lr *
                        (1 + std::cos(M_PI * double(step++) / double(steps)));
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
      }
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(
          forward(data.train_x.index_select(0, idx)),
          data.train_y.index_select(0, idx))
          .backward();
      optimizer.step();
    }
  }
  module->eval();
  torch::NoGradGuard no_grad;
  int64_t correct = 0;
  const auto tests = data.test_x.size(0);
  for (int64_t begin = 0; begin < tests; begin += 500) {
    const auto len = std::min<int64_t>(500, tests - begin);
    correct += forward(data.test_x.narrow(0, begin, len))
                   .argmax(1)
                   .eq(data.test_y.narrow(0, begin, len))
                   .sum()
                   .item<int64_t>();
  }
  return 100.0 * double(tests - correct) / double(tests);
}

}  // namespace

json accuracy_section(
    const std::string& data_dir, int seeds, int64_t epochs, int64_t limit) {
  const auto data = gpipe_data::read_fashion_mnist(data_dir);
  const Hyper hyper{epochs, limit};
  std::vector<AccuracyConfig> configs{{"plain", true}};
  for (int64_t chunks : {4, 8}) {
    for (bool dbn : {false, true}) {
      for (auto mode :
           {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
        configs.push_back(
            {"gpipe 2 lanes, chunks " + std::to_string(chunks) +
                 (dbn ? ", deferred BN" : "") + ", " + to_string(mode),
             false,
             chunks,
             dbn,
             mode});
      }
    }
  }
  at::set_num_threads(1);
  torch::manual_seed(0);
  const auto balance = balance_by_time(
      2, models::resnet_small(10), data.train_x.narrow(0, 0, 32), 0.3);
  std::printf(
      "\n# accuracy: resnet_small on Fashion-MNIST, %lld training images, "
      "%lld epochs, batch %lld, SGD lr %.2f (cosine decay per step) momentum "
      "0.9, %d seeds; top-1 "
      "test error (%%) on the 10,000 test images; balance [%lld, %lld]\n",
      (long long)std::min<int64_t>(limit, data.train_x.size(0)),
      (long long)epochs,
      (long long)hyper.batch,
      hyper.lr,
      seeds,
      (long long)balance[0],
      (long long)balance[1]);
  std::printf(
      "%-52s %8s %7s %9s   %s\n",
      "config",
      "error_%",
      "std",
      "vs_plain",
      "per seed");
  json rows = json::array();
  double plain_mean = 0;
  for (const auto& config : configs) {
    std::vector<double> errors;
    for (int seed = 0; seed < seeds; ++seed) {
      errors.push_back(train_once(config, balance, data, hyper, seed));
    }
    double mean = 0;
    for (double e : errors) {
      mean += e / errors.size();
    }
    double var = 0;
    for (double e : errors) {
      var += (e - mean) * (e - mean);
    }
    const double std_dev =
        errors.size() > 1 ? std::sqrt(var / (errors.size() - 1)) : 0.0;
    if (config.plain) {
      plain_mean = mean;
    }
    std::string each;
    for (double e : errors) {
      each += c10::str(e, " ");
    }
    std::printf(
        "%-52s %8.2f %7.2f %+9.2f   %s\n",
        config.name.c_str(),
        mean,
        std_dev,
        mean - plain_mean,
        each.c_str());
    std::fflush(stdout);
    rows.push_back(
        {{"config", config.name},
         {"test_error_percent_mean", mean},
         // (One seed has no spread: null.)
         {"test_error_percent_std",
          errors.size() > 1 ? json(std_dev) : json(nullptr)},
         {"difference_to_plain", mean - plain_mean},
         {"per_seed", errors}});
  }
  return {
      {"model", "resnet_small"},
      {"train_images", std::min<int64_t>(limit, data.train_x.size(0))},
      {"epochs", epochs},
      {"batch", hyper.batch},
      {"lr", hyper.lr},
      {"lr_schedule", "cosine per step"},
      {"seeds", seeds},
      {"balance", balance},
      {"rows", rows}};
}

}  // namespace gpipe::bench
