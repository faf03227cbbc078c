// GPipe::train_step: the loss inside the pipeline, under both schedules.

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common.h"
#include "error_of.h"

namespace gpipe {
namespace {

using testing::SeededTest;

using testing::PopAdd;
using testing::TanhStash;

// 8 layers; with skips, one from layer 1 to layer 6.
torch::nn::Sequential model_of(bool skips) {
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(5, 6));
  net->push_back(
      skips ? torch::nn::AnyModule(TanhStash())
            : torch::nn::AnyModule(torch::nn::Identity()));
  net->push_back(torch::nn::Linear(6, 6));
  net->push_back(torch::nn::Tanh());
  net->push_back(torch::nn::Linear(6, 6));
  net->push_back(torch::nn::Tanh());
  net->push_back(
      skips ? torch::nn::AnyModule(PopAdd())
            : torch::nn::AnyModule(torch::nn::Identity()));
  net->push_back(torch::nn::Linear(6, 4));
  return net;
}

class TrainStepTest
    : public SeededTest,
      public ::testing::WithParamInterface<
          std::tuple<Schedule, Checkpoint, bool, std::vector<int64_t>>> {};

TEST_P(TrainStepTest, GradientsEqualThePlainModel) {
  const auto& [schedule, mode, skips, balance] = GetParam();
  auto net = model_of(skips);
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(copy, GPipeOptions(balance).chunks(3).checkpoint(mode));
  // 7 rows in 3 chunks: micro-batches of 3, 3 and 1, weighted 3/7, 3/7,
  // 1/7.
  auto x = torch::randn({7, 5}, torch::kFloat64).requires_grad_(true);
  auto x2 = x.detach().clone().requires_grad_(true);
  auto target = torch::randint(0, 4, {7}, torch::kLong);
  auto loss_fn = [](torch::Tensor y, torch::Tensor t) {
    return torch::nn::functional::cross_entropy(y, t);
  };

  auto expected = loss_fn(net->forward(x), target);
  expected.backward();
  auto got = model->train_step(x2, target, loss_fn, schedule);
  EXPECT_EQ(got.dim(), 0);
  EXPECT_FALSE(got.requires_grad());
  EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12);
  ASSERT_TRUE(x2.grad().defined());
  EXPECT_TRUE(torch::allclose(x2.grad(), x.grad(), 1e-10, 1e-13));
  auto g1 = testing::grads_of(*net);
  auto g2 = testing::grads_of(*copy);
  ASSERT_EQ(g1.size(), g2.size());
  for (size_t k = 0; k < g1.size(); ++k) {
    ASSERT_TRUE(g2[k].defined()) << "parameter " << k;
    EXPECT_TRUE(torch::allclose(g2[k], g1[k], 1e-10, 1e-13))
        << "parameter " << k << ", max difference "
        << (g2[k] - g1[k]).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table,
    TrainStepTest,
    ::testing::Combine(
        ::testing::Values(Schedule::FillDrain, Schedule::OneFOneB),
        ::testing::Values(
            Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never),
        ::testing::Bool(),
        ::testing::Values(
            std::vector<int64_t>{8},
            std::vector<int64_t>{4, 4},
            std::vector<int64_t>{2, 2, 2, 2})));

TEST_F(TrainStepTest, SgdStepsEqualThePlainModel) {
  auto net = model_of(true);
  auto copy = testing::copy_of(net);
  GPipe model(copy, GPipeOptions({3, 5}).chunks(4));
  torch::optim::SGD opt1(net->parameters(), 0.1);
  torch::optim::SGD opt2(model->parameters(), 0.1);
  auto loss_fn = [](torch::Tensor y, torch::Tensor t) {
    return torch::mse_loss(y, t);
  };
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({8, 5});
    auto t = torch::randn({8, 4});
    opt1.zero_grad();
    loss_fn(net->forward(x), t).backward();
    opt1.step();
    opt2.zero_grad();
    model->train_step(x, t, loss_fn, Schedule::OneFOneB);
    opt2.step();
  }
  auto p1 = net->parameters();
  auto p2 = model->parameters();
  for (size_t k = 0; k < p1.size(); ++k) {
    EXPECT_TRUE(torch::allclose(p1[k], p2[k], 1e-5, 1e-6));
  }
}

// BatchNorm saves its running statistics for backward; 1F1B runs the
// recomputation of one micro-batch (which puts the statistics back) between
// the forward and backward of another. Regression test: that put-back must
// not look like an in-place change to the pending backward.
TEST_F(TrainStepTest, BatchNormUnderOneFOneBWithCheckpointing) {
  torch::nn::Sequential net(
      torch::nn::Linear(5, 6),
      torch::nn::BatchNorm1d(6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 6),
      torch::nn::BatchNorm1d(6),
      torch::nn::Linear(6, 4));
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(
      copy, GPipeOptions({3, 3}).chunks(4).checkpoint(Checkpoint::ExceptLast));
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto target = torch::randint(0, 4, {8}, torch::kLong);
  auto loss_fn = [](torch::Tensor y, torch::Tensor t) {
    return torch::nn::functional::cross_entropy(y, t);
  };
  // BatchNorm normalises each micro-batch on its own: the reference is the
  // plain model run micro-batch by micro-batch.
  auto xs = x.chunk(4);
  auto ts = target.chunk(4);
  for (size_t i = 0; i < xs.size(); ++i) {
    (loss_fn(net->forward(xs[i]), ts[i]) * 0.25).backward();
  }
  ASSERT_NO_THROW(model->train_step(x, target, loss_fn, Schedule::OneFOneB));
  auto g1 = testing::grads_of(*net);
  auto g2 = testing::grads_of(*copy);
  for (size_t k = 0; k < g1.size(); ++k) {
    EXPECT_TRUE(torch::allclose(g2[k], g1[k], 1e-10, 1e-13)) << k;
  }
  // Running statistics updated once per micro-batch, as the reference.
  auto b1 = net->buffers();
  auto b2 = copy->buffers();
  for (size_t k = 0; k < b1.size(); ++k) {
    EXPECT_TRUE(torch::allclose(
        b2[k].to(torch::kFloat64), b1[k].to(torch::kFloat64), 1e-10, 1e-13))
        << k;
  }
}

TEST_F(TrainStepTest, BadArguments) {
  auto net = model_of(false);
  GPipe model(net, GPipeOptions({4, 4}).chunks(2));
  auto x = torch::randn({4, 5});
  auto t = torch::randint(0, 4, {4}, torch::kLong);
  auto ce = [](torch::Tensor y, torch::Tensor t) {
    return torch::nn::functional::cross_entropy(y, t);
  };
  EXPECT_THROW(
      model->train_step(x, torch::randint(0, 4, {3}, torch::kLong), ce),
      c10::ValueError);
  auto not_scalar = [](torch::Tensor y, torch::Tensor) { return y; };
  EXPECT_THROW(model->train_step(x, t, not_scalar), c10::ValueError);
  EXPECT_THROW(model->train_step(x, t, LossFunction()), c10::ValueError);
  {
    torch::NoGradGuard no_grad;
    EXPECT_THROW(model->train_step(x, t, ce), c10::Error);
  }
  // A loss that throws on one micro-batch: reported with its place (the
  // second call is micro-batch 1's loss).
  GPipe never(
      model_of(false),
      GPipeOptions({4, 4}).chunks(2).checkpoint(Checkpoint::Never));
  int calls = 0;
  auto flaky = [&calls, &ce](torch::Tensor y, torch::Tensor t) {
    if (++calls == 2) {
      throw std::runtime_error("flaky loss");
    }
    return ce(y, t);
  };
  try {
    never->train_step(x, t, flaky, Schedule::OneFOneB);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("flaky loss"), std::string::npos);
    EXPECT_NE(
        std::string(e.what()).find("partition 1, micro-batch 1, loss"),
        std::string::npos)
        << e.what();
  }
  // The model still works.
  EXPECT_NO_THROW(never->train_step(x, t, ce, Schedule::OneFOneB));
}

TEST_F(TrainStepTest, MessagesReadWell) {
  auto x = torch::randn({4, 5});
  auto t = torch::randint(0, 4, {4}, torch::kLong);
  auto ce = [](torch::Tensor y, torch::Tensor t) {
    return torch::nn::functional::cross_entropy(y, t);
  };
  // A c10::Error from a layer gets its place in one pair of parentheses.
  torch::nn::Sequential net(
      torch::nn::Linear(5, 4),
      testing::lambda([](torch::Tensor x) -> torch::Tensor {
        TORCH_CHECK_VALUE(false, "layer refused");
      }));
  GPipe failing(net, GPipeOptions({1, 1}).chunks(2));
  std::string msg;
  try {
    failing->forward(x);
  } catch (const c10::ValueError& e) {
    msg = e.what_without_backtrace();
  }
  EXPECT_NE(msg.find("layer refused (in gpipe partition 1"), std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("(("), std::string::npos) << msg;
  // A 1-D batch (one sample, a newcomer's mistake) is read as 8 rows: the
  // first layer's error says how gpipe read it, in every pass.
  torch::nn::Sequential linear(torch::nn::Linear(8, 4));
  GPipe flat(linear, GPipeOptions({1}).chunks(2));
  const auto one_sample = torch::randn({8});
  for (const auto& pass : std::vector<std::function<void()>>{
           [&] { flat->forward(one_sample); },
           [&] { flat->forward_tuple(one_sample); },
           [&] {
             flat->train_step(
                 one_sample,
                 torch::zeros({8}),
                 [](torch::Tensor y, torch::Tensor t) { return y.sum(); },
                 Schedule::FillDrain);
           }}) {
    EXPECT_NE(
        testing::error_of(pass).find(
            "the input is 1-D, of shape [8]: gpipe takes "
            "dimension 0 as the batch"),
        std::string::npos)
        << testing::error_of(pass);
  }
  // Other errors of a 1-D batch (token ids, which an Embedding takes) are
  // left as they are.
  torch::nn::Sequential embed(torch::nn::Embedding(10, 4));
  GPipe ids(embed, GPipeOptions({1}).chunks(2));
  const auto no_hint = testing::error_of([&] {
    ids->train_step(
        torch::arange(8),
        torch::zeros({8}),
        [](torch::Tensor, torch::Tensor) -> torch::Tensor {
          TORCH_CHECK_VALUE(false, "loss refused");
        },
        Schedule::FillDrain);
  });
  EXPECT_NE(no_hint.find("loss refused"), std::string::npos) << no_hint;
  EXPECT_EQ(no_hint.find("the input is 1-D"), std::string::npos) << no_hint;
  // Counts agree with their nouns.
  GPipe one_lane(
      model_of(false), GPipeOptions({2, 2, 4}).chunks(1).stages_per_lane(3));
  msg.clear();
  try {
    one_lane->train_step(x, t, ce, make_plan(Schedule::FillDrain, 1, 1, 2));
  } catch (const c10::ValueError& e) {
    msg = e.what_without_backtrace();
  }
  EXPECT_NE(
      msg.find("the plan has 2 stages on 1 lane, but the pipeline has 3 "
               "partitions on 1 lane"),
      std::string::npos)
      << msg;
  msg.clear();
  try {
    GPipe(model_of(false), GPipeOptions({4, 4}).devices({torch::kCPU}));
  } catch (const c10::IndexError& e) {
    msg = e.what_without_backtrace();
  }
  EXPECT_NE(msg.find("at least 2 devices (one per lane"), std::string::npos)
      << msg;
  msg.clear();
  try {
    Plan plan = make_plan(Schedule::FillDrain, 1, 1);
    plan.lanes[0].push_back(Cell{1, 0, Phase::Forward});
    plan.validate();
  } catch (const c10::ValueError& e) {
    msg = e.what_without_backtrace();
  }
  EXPECT_NE(msg.find("outside 1 micro-batch and 1 stage"), std::string::npos)
      << msg;
}

}  // namespace
}  // namespace gpipe

namespace gpipe {
namespace {

// A step that is refused (a plan for other micro-batches, grad mode off)
// runs nothing and leaves the user's random generator where it was; a step
// that runs draws its one step seed.
TEST(TrainStepRandomTest, ARefusedStepLeavesTheGeneratorAlone) {
  torch::manual_seed(0);
  GPipe model(
      model_of(false),
      GPipeOptions({4, 4}).chunks(2).devices({torch::kCPU, torch::kCPU}));
  const auto x = torch::randn({4, 5});
  const auto y = torch::randn({4, 4});
  auto loss = [](torch::Tensor out, torch::Tensor target) {
    return torch::mse_loss(out, target);
  };
  const auto plan = training_plan(Schedule::OneFOneB, 3, 2);  // not 2
  const auto before = at::detail::getDefaultCPUGenerator().get_state();
  EXPECT_THROW(model->train_step(x, y, loss, plan), c10::ValueError);
  {
    torch::NoGradGuard no_grad;  // a caller's mistake: a ValueError
    EXPECT_THROW(model->train_step(x, y, loss), c10::ValueError);
  }
  EXPECT_TRUE(
      torch::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
  model->train_step(x, y, loss);
  EXPECT_FALSE(
      torch::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
}

// A plan without backward actions is refused with both counts, in the
// singular where they are one ("1 forwards" before).
TEST(TrainStepRandomTest, AForwardOnlyPlanIsRefusedWithItsCounts) {
  GPipe model(model_of(false), GPipeOptions({8}).chunks(1));
  const auto x = torch::randn({4, 5});
  const auto y = torch::randn({4, 4});
  auto loss = [](torch::Tensor out, torch::Tensor target) {
    return torch::mse_loss(out, target);
  };
  const auto msg = testing::error_of(
      [&] { model->train_step(x, y, loss, forward_plan(1, 1)); });
  EXPECT_NE(
      msg.find("it has 1 forward and 0 backward actions"), std::string::npos)
      << msg;
}

}  // namespace
}  // namespace gpipe
