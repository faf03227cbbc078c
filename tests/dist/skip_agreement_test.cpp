// Skips between ranks are matched by where they are in the model, not by
// the order in which each rank made its namespaces; and ranks that disagree
// on the skips fail when the stages are built. Ranks are threads of this
// process (see mesh_test.cpp).

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

// Stashes `scale` * x under "s" and passes x on.
struct ScaleStashImpl : torch::nn::Cloneable<ScaleStashImpl>, Skippable {
  explicit ScaleStashImpl(double scale = 1)
      : Skippable({"s"}, {}), scale(scale) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    stash("s", x * scale);
    return x;
  }
  double scale;
};
TORCH_MODULE(ScaleStash);

// Pops "s" and adds it (common.h's PopAdd pops "skip").
struct PopAddSImpl : torch::nn::Cloneable<PopAddSImpl>, Skippable {
  PopAddSImpl() : Skippable({}, {"s"}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    return x + pop("s");
  }
};
TORCH_MODULE(PopAddS);

// Two blocks, each with a skip named "s" in a namespace of its own, both
// from partition 0 to partition 1 (balance 4, 4). `a_first`: which
// namespace is made first; `crossed`: each pop takes the other block's
// skip (the same layers and shapes, other routes).
torch::nn::Sequential build(bool a_first, bool crossed = false) {
  Namespace first;
  Namespace second;
  const auto& a = a_first ? first : second;
  const auto& b = a_first ? second : first;
  torch::manual_seed(0);
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(4, 4));
  auto stash_a = ScaleStash(2.0);
  stash_a->isolate(a);
  net->push_back(stash_a);
  net->push_back(torch::nn::Linear(4, 4));
  auto stash_b = ScaleStash(-3.0);
  stash_b->isolate(b);
  net->push_back(stash_b);
  auto pop_a = PopAddS();
  pop_a->isolate(crossed ? b : a);
  net->push_back(pop_a);
  net->push_back(torch::nn::Tanh());
  auto pop_b = PopAddS();
  pop_b->isolate(crossed ? a : b);
  net->push_back(pop_b);
  net->push_back(torch::nn::Linear(4, 2));
  net->to(torch::kDouble);
  return net;
}

TEST(SkipAgreementTest, NamespacesMadeInAnotherOrderStillMatchTheirSkips) {
  const auto options = GPipeOptions({4, 4}).chunks(2).threads_per_lane(1);
  torch::manual_seed(1);
  const auto x = torch::randn({6, 4}, torch::kDouble);
  const auto y = torch::randint(0, 2, {6}, torch::kLong);
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  GPipe ref(build(true), options);
  const auto expected = ref->train_step(x, y, loss_fn, Schedule::OneFOneB);
  // Rank 1 makes its namespaces in the other order.
  std::vector<torch::nn::Sequential> nets{build(true), build(false)};
  std::mutex mutex;
  std::vector<double> losses(2);
  run_ranks(2, [&](World world) {
    const auto r = world.rank();
    dist::PipelineStage stage(nets[r], options, world);
    auto loss = stage->train_step(
        r == 0 ? x : torch::Tensor(),
        r == 1 ? y : torch::Tensor(),
        loss_fn,
        Schedule::OneFOneB);
    std::lock_guard<std::mutex> lock(mutex);
    losses[r] = loss.item<double>();
  });
  EXPECT_NEAR(losses[0], expected.item<double>(), 1e-12);
  EXPECT_NEAR(losses[1], expected.item<double>(), 1e-12);
}

// What each of two ranks, rank r building a stage of `nets[r]`, was told
// (empty where the stage was built).
std::vector<std::string> errors_of_building(
    const std::vector<torch::nn::Sequential>& nets,
    const GPipeOptions& options) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  run_ranks(2, [&](World world) {
    try {
      dist::PipelineStage stage(nets[world.rank()], options, world);
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[world.rank()] = e.what_without_backtrace();
    }
  });
  return errors;
}

TEST(SkipAgreementTest, RanksWhoseSkipsDifferFailWhenBuilt) {
  const auto options = GPipeOptions({4, 4}).chunks(2).threads_per_lane(1);
  std::vector<torch::nn::Sequential> nets{build(true), build(true, true)};
  const auto errors = errors_of_building(nets, options);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("skips"), std::string::npos) << e;
  }
}

// Ranks whose models differ in one layer's type, or in one tensor's
// dtype, are told which: the first entry that differs, on both sides.
TEST(SkipAgreementTest, RanksWhoseLayersDifferAreToldWhich) {
  const auto options = GPipeOptions({2, 2}).chunks(2).threads_per_lane(1);
  auto net = [](bool relu, bool dbl) {
    torch::nn::Sequential n(
        torch::nn::Linear(4, 4),
        torch::nn::Tanh(),
        torch::nn::Linear(4, 4),
        torch::nn::Tanh());
    if (relu) {
      n = torch::nn::Sequential(
          torch::nn::Linear(4, 4),
          torch::nn::ReLU(),
          torch::nn::Linear(4, 4),
          torch::nn::Tanh());
    }
    if (dbl) {
      n[2]->to(torch::kDouble);
    }
    return n;
  };
  for (const bool layer : {true, false}) {
    std::vector<torch::nn::Sequential> nets{
        net(false, false), net(layer, !layer)};
    const auto errors = errors_of_building(nets, options);
    const std::vector<std::string> expected = layer
        ? std::vector<std::string>{"'1: torch::nn::TanhImpl' (entry 2 of 4)",
                                   "'1: torch::nn::ReLUImpl' (entry 2 of 4)"}
        : std::vector<std::string>{"'2.weight [4, 4] Float' (entry 3 of 4)",
                                   "'2.weight [4, 4] Double' (entry 3 of 4)"};
    for (const auto& e : errors) {
      for (const auto& part : expected) {
        EXPECT_NE(e.find(part), std::string::npos) << e;
      }
    }
  }
}

}  // namespace
}  // namespace gpipe
