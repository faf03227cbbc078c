// DeferredBatchNorm alone (ports torchgpipe's test_deferred_batch_norm) and
// through GPipe's deferred_batch_norm option.

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common.h"

namespace gpipe {
namespace {

using testing::SeededTest;

constexpr int64_t kChunks = 4;

class DeferredBatchNormTest : public SeededTest {};

void expect_close(
    const torch::Tensor& a,
    const torch::Tensor& b,
    double rtol = 1e-10,
    double atol = 1e-12) {
  ASSERT_EQ(a.sizes(), b.sizes());
  EXPECT_TRUE(torch::allclose(a, b, rtol, atol))
      << "max difference " << (a - b).abs().max().item<double>();
}

TEST_F(DeferredBatchNormTest, EachChunkIsNormalisedLikeBatchNormOnIt) {
  for (bool input_requires_grad : {false, true}) {
    torch::nn::BatchNorm2d bn(3);
    DeferredBatchNorm dbn(DeferredBatchNormOptions(3).chunks(kChunks));
    bn->to(torch::kFloat64);
    dbn->to(torch::kFloat64);
    auto x1 = torch::randn({16, 3, 5, 5}, torch::kFloat64);
    x1.requires_grad_(input_requires_grad);
    auto x2 = x1.detach().clone().requires_grad_(input_requires_grad);
    for (const auto& chunk : x1.chunk(kChunks)) {
      bn(chunk).sum().backward();
    }
    for (const auto& chunk : x2.chunk(kChunks)) {
      dbn(chunk).sum().backward();
    }
    expect_close(dbn->weight.grad(), bn->weight.grad());
    expect_close(dbn->bias.grad(), bn->bias.grad());
    if (input_requires_grad) {
      expect_close(x2.grad(), x1.grad());
    }
  }
}

TEST_F(DeferredBatchNormTest, RunningStatsEqualBatchNormOnTheWholeBatch) {
  for (c10::optional<double> momentum :
       {c10::optional<double>(0.1), c10::optional<double>()}) {
    torch::nn::BatchNorm2d bn(
        torch::nn::BatchNormOptions(3).momentum(momentum));
    DeferredBatchNorm dbn(
        DeferredBatchNormOptions(3).momentum(momentum).chunks(kChunks));
    bn->to(torch::kFloat64);
    dbn->to(torch::kFloat64);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({16, 3, 5, 5}, torch::kFloat64) * 3 + 1;
      bn(x);
      for (const auto& chunk : x.chunk(kChunks)) {
        dbn(chunk);
      }
      expect_close(dbn->running_mean, bn->running_mean);
      expect_close(dbn->running_var, bn->running_var);
      EXPECT_EQ(
          dbn->num_batches_tracked.item<int64_t>(),
          bn->num_batches_tracked.item<int64_t>());
    }
  }
}

TEST_F(DeferredBatchNormTest, EvalUsesTheRunningStats) {
  torch::nn::BatchNorm1d bn(4);
  DeferredBatchNorm dbn(DeferredBatchNormOptions(4).chunks(2));
  auto x = torch::randn({8, 4});
  bn(x);
  for (const auto& chunk : x.chunk(2)) {
    dbn(chunk);
  }
  bn->eval();
  dbn->eval();
  auto y = torch::randn({5, 4});
  expect_close(dbn(y), bn(y), 1e-5, 1e-6);
}

TEST_F(DeferredBatchNormTest, RecomputationDoesNotAccumulate) {
  DeferredBatchNorm dbn(DeferredBatchNormOptions(2).chunks(2));
  auto x = torch::randn({4, 2});
  {
    detail::RecomputingGuard recomputing;
    dbn(x);
  }
  EXPECT_EQ(dbn->tracked(), 0);
  dbn(x);
  EXPECT_EQ(dbn->tracked(), 1);
}

TEST_F(DeferredBatchNormTest, AccumulatorsCarryNoGraph) {
  DeferredBatchNorm dbn(DeferredBatchNormOptions(2).chunks(1));
  auto x = torch::randn({4, 2}, torch::requires_grad());
  dbn(x);
  EXPECT_FALSE(dbn->running_mean.requires_grad());
  EXPECT_FALSE(dbn->running_var.requires_grad());
}

TEST_F(DeferredBatchNormTest, BadInput) {
  DeferredBatchNorm dbn(3);
  EXPECT_THROW(dbn(torch::randn({3})), c10::ValueError);
  EXPECT_THROW(dbn(torch::randn({2, 4})), c10::ValueError);
  EXPECT_THROW(DeferredBatchNorm(0), c10::ValueError);
}

// One value per channel in training normalised to zeros, whatever the input
// (the output of a GPipe with one row per micro-batch did not depend on it);
// BatchNorm refuses it, and so does DeferredBatchNorm now. In eval mode, and
// with more than one value (one row of a 2x2 image), it runs.
TEST_F(DeferredBatchNormTest, OneValuePerChannelInTrainingIsRefused) {
  DeferredBatchNorm dbn(3);
  EXPECT_THROW(dbn(torch::randn({1, 3})), c10::ValueError);
  EXPECT_NO_THROW(dbn(torch::randn({1, 3, 2, 2})));
  dbn->eval();
  EXPECT_NO_THROW(dbn(torch::randn({1, 3})));
  torch::nn::Sequential net(
      torch::nn::Linear(3, 3),
      torch::nn::BatchNorm1d(3),
      torch::nn::Linear(3, 3));
  GPipe model(net, GPipeOptions({2, 1}).chunks(4).deferred_batch_norm(true));
  try {
    model->forward(torch::randn({4, 3}));
    ADD_FAILURE() << "one row per micro-batch was normalised";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("expects more than 1 value per channel when training"),
        std::string::npos)
        << e.what_without_backtrace();
  }
  // Two rows per micro-batch run.
  EXPECT_NO_THROW(model->forward(torch::randn({8, 3})));
}

TEST_F(DeferredBatchNormTest, Convert) {
  DeferredBatchNorm already(DeferredBatchNormOptions(3).chunks(kChunks));
  torch::nn::Sequential net(
      torch::nn::Conv2d(3, 3, 1),
      torch::nn::BatchNorm2d(3),
      torch::nn::BatchNorm2d(
          torch::nn::BatchNormOptions(3).track_running_stats(false)),
      already);
  auto converted = convert_deferred_batch_norm(net, kChunks);
  ASSERT_EQ(converted->size(), 4u);
  auto* replaced = converted[1]->as<DeferredBatchNormImpl>();
  ASSERT_NE(replaced, nullptr);
  EXPECT_EQ(replaced->options.chunks(), kChunks);
  // Shares the replaced layer's parameters and buffers.
  auto* bn = net[1]->as<torch::nn::BatchNorm2dImpl>();
  EXPECT_TRUE(replaced->weight.is_same(bn->weight));
  EXPECT_TRUE(replaced->running_mean.is_same(bn->running_mean));
  // Not tracking running stats: left alone.
  EXPECT_NE(converted[2]->as<torch::nn::BatchNorm2dImpl>(), nullptr);
  // Same chunks: the same object; other chunks: a new one, sharing.
  EXPECT_EQ(converted[3].get(), already.get());
  auto again = convert_deferred_batch_norm(net, 2);
  auto* other = again[3]->as<DeferredBatchNormImpl>();
  EXPECT_NE(other, already.get());
  EXPECT_EQ(other->options.chunks(), 2);
  EXPECT_TRUE(other->weight.is_same(already->weight));
  // The names stay: state dicts match.
  auto keys = [](torch::nn::Module& m) {
    std::vector<std::string> out;
    for (const auto& p : m.named_parameters()) {
      out.push_back(p.key());
    }
    for (const auto& b : m.named_buffers()) {
      out.push_back(b.key());
    }
    return out;
  };
  EXPECT_EQ(keys(*converted), keys(*net));
}

// A GPipe with deferred_batch_norm runs a DeferredBatchNorm in place of
// the user's BatchNorm: eval() and train() on either the GPipe or the
// user's Sequential reach both, as they reach every layer the two share;
// a copy follows nothing.
TEST_F(DeferredBatchNormTest, ModesReachTheReplacedBatchNormBothWays) {
  torch::nn::Sequential net(
      torch::nn::Linear(8, 16),
      torch::nn::BatchNorm1d(16),
      torch::nn::ReLU(),
      torch::nn::Linear(16, 4));
  GPipe model(
      net, GPipeOptions({2, 2}).chunks(kChunks).deferred_batch_norm(true));
  const auto x = torch::randn({8, 8});
  model->forward(x);  // running statistics to use
  const auto running = net[1]->as<torch::nn::BatchNorm1dImpl>()->running_mean;
  const auto before = running.clone();

  net->eval();
  {
    torch::NoGradGuard no_grad;
    const auto ours = model->forward(x);
    EXPECT_TRUE(ours.allclose(net->forward(x), 1e-6, 1e-6));
  }
  EXPECT_TRUE(running.equal(before));  // not updated in evaluation

  net->train();
  model->eval();
  EXPECT_FALSE(net[1]->is_training());
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(model->forward(x).allclose(net->forward(x), 1e-6, 1e-6));
  }
  model->train();
  EXPECT_TRUE(net[1]->is_training());

  // A copy of the layer does not move the user's BatchNorm.
  auto deferred = std::dynamic_pointer_cast<DeferredBatchNormImpl>(
      model->partitions()->ptr(0)->as<torch::nn::SequentialImpl>()->ptr(1));
  ASSERT_NE(deferred, nullptr);
  auto copy =
      std::dynamic_pointer_cast<DeferredBatchNormImpl>(deferred->clone());
  copy->eval();
  EXPECT_TRUE(net[1]->is_training());
  EXPECT_TRUE(deferred->in_training());
}

struct BlockWithBatchNormImpl : torch::nn::Module {
  BlockWithBatchNormImpl() {
    bn = register_module("bn", torch::nn::BatchNorm1d(2));
  }
  torch::Tensor forward(torch::Tensor x) {
    return bn(x);
  }
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BlockWithBatchNorm);

TEST_F(DeferredBatchNormTest, BatchNormInsideAnotherModuleIsRefused) {
  auto net = torch::nn::Sequential(BlockWithBatchNorm(), torch::nn::Identity());
  try {
    convert_deferred_batch_norm(net, 2);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'0.bn'"), std::string::npos)
        << e.what();
  }
}

// A block that says it converts itself but leaves its BatchNorm in place.
struct CarelessBlockImpl : torch::nn::Cloneable<CarelessBlockImpl>,
                           ConvertibleToDeferredBatchNorm {
  CarelessBlockImpl() {
    reset();
  }
  void reset() override {
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
  }
  torch::Tensor forward(torch::Tensor x) {
    return bn(x);
  }
  torch::nn::AnyModule to_deferred_batch_norm(int64_t) const override {
    return torch::nn::AnyModule(std::make_shared<CarelessBlockImpl>(*this));
  }
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(CarelessBlock);

TEST_F(DeferredBatchNormTest, AConversionThatLeavesABatchNormIsRefused) {
  auto net = torch::nn::Sequential(torch::nn::Identity(), CarelessBlock());
  try {
    convert_deferred_batch_norm(net, 2);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'1.bn'"), std::string::npos) << what;
    EXPECT_NE(what.find("to_deferred_batch_norm left it"), std::string::npos)
        << what;
  }
}

// --- through GPipe ---

// One BatchNorm (the layers after a BatchNorm see micro-batches normalised
// on their own, so only the first BatchNorm's input equals the plain
// model's); balance {4, 3} puts it in partition 0, {3, 4} in partition 1.
torch::nn::Sequential bn_model() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(2, 4, 3),
      torch::nn::ReLU(),
      torch::nn::Conv2d(4, 4, 3),
      torch::nn::BatchNorm2d(4),
      torch::nn::ReLU(),
      torch::nn::Flatten(),
      torch::nn::Linear(4 * 4 * 4, 3));
}

class DeferredBatchNormGPipeTest
    : public SeededTest,
      public ::testing::WithParamInterface<
          std::tuple<Checkpoint, std::vector<int64_t>>> {};

TEST_P(DeferredBatchNormGPipeTest, RunningStatsEqualThePlainModelsOnTheBatch) {
  auto net = bn_model();
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(
      copy,
      GPipeOptions(std::get<1>(GetParam()))
          .chunks(kChunks)
          .checkpoint(std::get<0>(GetParam()))
          .deferred_batch_norm(true));
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({16, 2, 8, 8}, torch::kFloat64);
    net->forward(x).sum().backward();
    model->forward(x).sum().backward();
    // A batch smaller than chunks: fewer micro-batches, one update still.
    auto small = torch::randn({6, 2, 8, 8}, torch::kFloat64);
    net->forward(small);
    model->forward(small);
  }
  auto expected = net->named_buffers();
  auto got = model->named_buffers();
  ASSERT_EQ(expected.size(), got.size());
  for (size_t k = 0; k < expected.size(); ++k) {
    expect_close(
        got[k].value().to(torch::kFloat64),
        expected[k].value().to(torch::kFloat64));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes,
    DeferredBatchNormGPipeTest,
    ::testing::Combine(
        ::testing::Values(
            Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never),
        ::testing::Values(
            std::vector<int64_t>{4, 3}, std::vector<int64_t>{3, 4})));

// A momentum (or eps) changed on the user's BatchNorm between steps, as a
// momentum schedule does: the plain model uses it from then on, and so does
// the DeferredBatchNorm that stands in for it (it kept the options it was
// made with: running means off by 0.9 relative after 3 more steps). In
// eval the changed eps applies too.
TEST_F(DeferredBatchNormGPipeTest, OptionsChangedOnTheBatchNormApplyFromThen) {
  auto net = bn_model();
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(
      copy, GPipeOptions({4, 3}).chunks(kChunks).deferred_batch_norm(true));
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      for (auto* n : {&net, &copy}) {
        (**n)[3]->as<torch::nn::BatchNorm2dImpl>()->options.momentum(0.5).eps(
            0.25);
      }
    }
    auto x = torch::randn({16, 2, 8, 8}, torch::kFloat64) * 2 + 1;
    net->forward(x).sum().backward();
    model->forward(x).sum().backward();
  }
  auto expected = net->named_buffers();
  auto got = model->named_buffers();
  ASSERT_EQ(expected.size(), got.size());
  for (size_t k = 0; k < expected.size(); ++k) {
    expect_close(got[k].value(), expected[k].value());
  }
  net->eval();
  model->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({8, 2, 8, 8}, torch::kFloat64);
  expect_close(model->forward(x), net->forward(x));
}

TEST_F(DeferredBatchNormGPipeTest, WithChunksOneGradientsEqualThePlainModel) {
  auto net = bn_model();
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(
      copy,
      GPipeOptions({4, 3})
          .chunks(1)
          .checkpoint(Checkpoint::Always)
          .deferred_batch_norm(true));
  auto x = torch::randn({6, 2, 8, 8}, torch::kFloat64);
  expect_close(model->forward(x), net->forward(x).detach());
  net->forward(x).pow(2).sum().backward();
  model->forward(x).pow(2).sum().backward();
  auto g1 = testing::grads_of(*net);
  auto g2 = testing::grads_of(*copy);
  for (size_t k = 0; k < g1.size(); ++k) {
    expect_close(g2[k], g1[k]);
  }
}

TEST_F(DeferredBatchNormGPipeTest, FrozenBatchNormStaysFrozen) {
  // Converting registered the shared weight and bias as parameters that
  // require grad, which set the flag on the user's own tensors: a frozen
  // BatchNorm (fine-tuning's usual set-up) got gradients and trained.
  auto net = bn_model();
  net->to(torch::kFloat64);
  for (const auto& child : net->children()) {
    if (auto* bn = child->as<torch::nn::BatchNorm2dImpl>()) {
      bn->weight.requires_grad_(false);
      bn->bias.requires_grad_(false);
    }
  }
  auto frozen = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& child : net->children()) {
      if (auto* bn = child->as<torch::nn::BatchNorm2dImpl>()) {
        out.push_back(bn->weight);
        out.push_back(bn->bias);
      }
    }
    return out;
  };
  ASSERT_FALSE(frozen().empty());
  (void)convert_deferred_batch_norm(net, 2);
  for (const auto& p : frozen()) {
    EXPECT_FALSE(p.requires_grad());
  }
  GPipe model(net, GPipeOptions({4, 3}).chunks(2).deferred_batch_norm(true));
  const auto x = torch::randn({6, 2, 8, 8}, torch::kFloat64);
  model->train_step(
      x,
      torch::zeros({6}, torch::kFloat64),
      [](torch::Tensor out, torch::Tensor) { return out.pow(2).mean(); },
      Schedule::OneFOneB);
  for (const auto& p : frozen()) {
    EXPECT_FALSE(p.requires_grad());
    EXPECT_FALSE(p.grad().defined());
  }
  // A trainable BatchNorm still trains.
  auto trainable = bn_model();
  GPipe other(
      trainable, GPipeOptions({4, 3}).chunks(2).deferred_batch_norm(true));
  other->forward(torch::randn({6, 2, 8, 8})).pow(2).mean().backward();
  for (const auto& child : trainable->children()) {
    if (auto* bn = child->as<torch::nn::BatchNorm2dImpl>()) {
      EXPECT_TRUE(bn->weight.grad().defined());
    }
  }
}

TEST_F(DeferredBatchNormGPipeTest, FailedMiniBatchLeavesNoStatistics) {
  torch::nn::Sequential net(
      torch::nn::Linear(2, 2),
      torch::nn::BatchNorm1d(2),
      testing::Raise(false));
  GPipe model(net, GPipeOptions({2, 1}).chunks(2).deferred_batch_norm(true));
  auto x = torch::randn({4, 2});
  auto* raise = (*model)[2]->as<testing::RaiseImpl>();
  raise->armed = true;
  EXPECT_THROW(model->forward(x), c10::Error);
  auto* dbn = (*model)[1]->as<DeferredBatchNormImpl>();
  ASSERT_NE(dbn, nullptr);
  EXPECT_EQ(dbn->tracked(), 0);
  EXPECT_EQ(dbn->num_batches_tracked.item<int64_t>(), 0);
  EXPECT_TRUE(torch::equal(dbn->running_mean, torch::zeros({2})));
  raise->armed = false;
  model->forward(x);
  EXPECT_EQ(dbn->num_batches_tracked.item<int64_t>(), 1);
}

}  // namespace
}  // namespace gpipe
