// What the last rank's loss trains when the model itself has nothing to
// train: a frozen model whose loss reads a learnable temperature, with the
// ranks as threads of this process (tests/dist/ranks.h).

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <string>
#include <vector>

#include "dist/ranks.h"

namespace gpipe {
namespace {

using dist::World;
using dist::testing::run_ranks;

torch::nn::Sequential frozen_net() {
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(5, 6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 4),
      torch::nn::Tanh());
  net->to(torch::kFloat64);
  for (auto& p : net->parameters()) {
    p.requires_grad_(false);
  }
  return net;
}

// A frozen model's loss that reads a temperature gets its gradient on the
// last rank (the stage found nothing to train and kept no loss to
// back-propagate: it got none). Nothing to train at all is refused on every
// rank (as any failed step, it ends the job's connections).
TEST(DistLossTest, AFrozenModelsLossTrainsWhatItReadsOnTheLastRank) {
  torch::manual_seed(1);
  const auto x = torch::randn({8, 5}, torch::kFloat64);
  const auto t = torch::randint(0, 4, {8});
  auto plain_temperature =
      torch::full({}, 1.5, torch::kFloat64).set_requires_grad(true);
  const auto plain_loss = torch::nn::functional::cross_entropy(
      frozen_net()->forward(x) / plain_temperature, t);
  plain_loss.backward();
  const auto expected = plain_temperature.grad();
  // Built here, not in the ranks' threads: the generator is the process's,
  // and two threads seeding and drawing from it at once make two models.
  std::vector<torch::nn::Sequential> nets = {frozen_net(), frozen_net()};
  std::mutex mutex;
  std::vector<std::string> errors;
  run_ranks(2, [&](World world) {
    auto temperature =
        torch::full({}, 1.5, torch::kFloat64).set_requires_grad(true);
    const LossFunction scaled = [&](torch::Tensor y, torch::Tensor target) {
      return torch::nn::functional::cross_entropy(y / temperature, target);
    };
    dist::PipelineStage stage(
        nets[world.rank()], GPipeOptions({2, 2}).chunks(4), world);
    const bool first = world.rank() == 0;
    const bool last = world.rank() == 1;
    for (auto schedule : {Schedule::FillDrain, Schedule::OneFOneB}) {
      const auto loss = stage->train_step(
          first ? x : torch::Tensor(),
          last ? t : torch::Tensor(),
          scaled,
          schedule);
      EXPECT_NEAR(loss.item<double>(), plain_loss.item<double>(), 1e-12);
      if (last) {
        ASSERT_TRUE(temperature.grad().defined()) << to_string(schedule);
        EXPECT_TRUE(torch::allclose(temperature.grad(), expected, 1e-10, 1e-13))
            << temperature.grad() << " against " << expected;
        temperature.mutable_grad().reset();
      }
    }
    try {
      stage->train_step(
          first ? x : torch::Tensor(),
          last ? t : torch::Tensor(),
          [](torch::Tensor y, torch::Tensor target) {
            return torch::nn::functional::cross_entropy(y, target);
          });
      ADD_FAILURE() << "rank " << world.rank() << ": no error";
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors.push_back(e.what_without_backtrace());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("expects something to train"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace gpipe
