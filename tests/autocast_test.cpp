// Autocast through the lanes and in recomputations (Note [Autocast in
// cells] in src/engine/autocast.cpp), and a parameter unfrozen between a
// forward and its backward (Note [The modes of a recomputation]).

#include <ATen/autocast_mode.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <string>

#include "common.h"

namespace {

using gpipe::Checkpoint;
using gpipe::GPipe;
using gpipe::GPipeOptions;
using gpipe::testing::copy_of;

torch::nn::Sequential autocast_mlp() {
  torch::manual_seed(1);
  return torch::nn::Sequential(
      torch::nn::Linear(6, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 5));
}

// LibTorch 2.4 made the per-device calls one call with a device type.
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
void set_cpu_autocast(bool on) {
  at::autocast::set_autocast_enabled(at::kCPU, on);
}
bool cpu_autocast() {
  return at::autocast::is_autocast_enabled(at::kCPU);
}
#else
void set_cpu_autocast(bool on) {
  at::autocast::set_cpu_enabled(on);
}
bool cpu_autocast() {
  return at::autocast::is_cpu_enabled();
}
#endif

// CPU autocast on while alive; off, with this thread's cache cleared, after.
struct CpuAutocast {
  CpuAutocast() {
    set_cpu_autocast(true);
  }
  ~CpuAutocast() {
    off();
  }
  static void off() {
    set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
};

double max_difference_as_float(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat) - b.to(torch::kFloat)).abs().max().item<double>();
}

// bfloat16 keeps 8 bits: the micro-batches' products round apart from the
// whole batch's by about 1e-2 here; a stale weight is off by units.
constexpr double kBf16Tolerance = 0.05;

const Checkpoint kAutocastModes[] = {
    Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never};

// Each lane kept the bfloat16 copies autocast made of the weights in the
// first step, and the caller's clear_cache() never reached them: after an
// optimizer step the outputs were the old weights' (off by up to 7.7).
TEST(AutocastTest, OutputsFollowTheWeightsFromStepToStep) {
  for (const auto mode : kAutocastModes) {
    auto net = autocast_mlp();
    auto plain = copy_of(net);
    GPipe model(net, GPipeOptions({2, 1, 2}).chunks(3).checkpoint(mode));
    const auto x = torch::randn({8, 6});
    for (int step = 0; step < 3; ++step) {
      torch::Tensor expected;
      torch::Tensor got;
      {
        CpuAutocast autocast;
        torch::NoGradGuard no_grad;
        expected = plain->forward(x);
        got = model->forward(x);
      }
      EXPECT_EQ(got.scalar_type(), expected.scalar_type());
      EXPECT_LT(max_difference_as_float(got, expected), kBf16Tolerance)
          << to_string(mode) << ", step " << step;
      torch::NoGradGuard no_grad;
      for (auto* n : {&net, &plain}) {
        for (auto& p : (*n)->parameters()) {
          p.add_(0.5);  // an optimizer's step
        }
      }
    }
  }
}

// The usual pattern: the forward under autocast, the backward after it. A
// checkpointed cell's recomputation ran in float32 on its bfloat16 input
// ("mat1 and mat2 must have the same dtype"); inside the region, the
// checkpointed forward (without grad) cached casts without a graph, which
// the recomputation used, and the biases got no gradient.
TEST(AutocastTest, GradientsAreThePlainModelsWhereverTheBackwardRuns) {
  for (const bool backward_inside : {false, true}) {
    for (const auto mode : kAutocastModes) {
      auto net = autocast_mlp();
      auto plain = copy_of(net);
      GPipe model(net, GPipeOptions({2, 1, 2}).chunks(3).checkpoint(mode));
      const auto x = torch::randn({8, 6});
      {
        CpuAutocast autocast;
        auto expected = plain->forward(x);
        auto got = model->forward(x);
        if (!backward_inside) {
          CpuAutocast::off();
        }
        expected.to(torch::kFloat).sum().backward();
        got.to(torch::kFloat).sum().backward();
      }
      const auto want = plain->named_parameters();
      for (const auto& item : net->named_parameters()) {
        const auto& g = item.value().grad();
        const auto& e = want[item.key()].grad();
        ASSERT_TRUE(g.defined())
            << to_string(mode) << ": " << item.key() << " got no gradient"
            << (backward_inside ? " (backward inside)" : "");
        EXPECT_LT(
            max_difference_as_float(g, e),
            kBf16Tolerance * (1 + e.abs().max().item<double>()))
            << to_string(mode) << ": " << item.key();
      }
    }
  }
}

// train_step under autocast: the loss and the recomputations run under it
// too, and the step's gradients are the plain model's.
TEST(AutocastTest, ATrainingStepUnderAutocastHasThePlainGradients) {
  const auto x = torch::randn({9, 6});
  const auto t = torch::randint(0, 5, {9});
  const auto loss_fn = [](torch::Tensor y, torch::Tensor target) {
    return torch::nn::functional::cross_entropy(y.to(torch::kFloat), target);
  };
  for (const auto mode : kAutocastModes) {
    auto net = autocast_mlp();
    auto plain = copy_of(net);
    GPipe model(net, GPipeOptions({2, 1, 2}).chunks(3).checkpoint(mode));
    {
      CpuAutocast autocast;
      loss_fn(plain->forward(x), t).backward();
      model->train_step(x, t, loss_fn);
    }
    const auto want = plain->named_parameters();
    for (const auto& item : net->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      const auto& e = want[item.key()].grad();
      EXPECT_LT(
          max_difference_as_float(item.value().grad(), e),
          kBf16Tolerance * (1 + e.abs().max().item<double>()))
          << to_string(mode) << ": " << item.key();
    }
  }
}

// Autocast left as the caller had it, on the caller's thread: a pass sets
// it for its cells only.
TEST(AutocastTest, ThePassLeavesTheCallersSettingsAsTheyWere) {
  GPipe model(autocast_mlp(), GPipeOptions({2, 1, 2}).chunks(1));
  const auto x = torch::randn({4, 6});
  {
    CpuAutocast autocast;
    model->forward(x).to(torch::kFloat).sum().backward();
    EXPECT_TRUE(cpu_autocast());
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  }
  model->forward(x).sum().backward();
  EXPECT_FALSE(cpu_autocast());
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
}

// A parameter frozen for the forward and unfrozen before the backward: the
// plain model's graph has no path to it, and it gets no gradient. The
// recomputation of a checkpointed cell used to build one and give it the
// checkpointed micro-batches' share.
TEST(FrozenTest, AParameterUnfrozenBeforeTheBackwardGetsNoGradient) {
  for (const auto mode : kAutocastModes) {
    auto net = autocast_mlp();
    auto plain = copy_of(net);
    GPipe model(net, GPipeOptions({2, 1, 2}).chunks(3).checkpoint(mode));
    const auto x = torch::randn({8, 6}, torch::kFloat);
    for (auto* n : {&net, &plain}) {
      for (auto& p : (**n)[2]->parameters()) {
        p.requires_grad_(false);
      }
    }
    auto expected = plain->forward(x);
    auto got = model->forward(x);
    for (auto* n : {&net, &plain}) {
      for (auto& p : (**n)[2]->parameters()) {
        p.requires_grad_(true);
      }
    }
    expected.sum().backward();
    got.sum().backward();
    const auto want = plain->named_parameters();
    for (const auto& item : net->named_parameters()) {
      const auto& e = want[item.key()].grad();
      const auto& g = item.value().grad();
      ASSERT_EQ(g.defined(), e.defined())
          << to_string(mode) << ": " << item.key();
      if (e.defined()) {
        EXPECT_TRUE(torch::allclose(g, e, 1e-5, 1e-6))
            << to_string(mode) << ": " << item.key();
      }
      EXPECT_TRUE(item.value().requires_grad()) << item.key();
    }
  }
}

}  // namespace
