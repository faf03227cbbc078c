// The loss as a plan action: it runs wherever the plan lists it, its
// randomness is seeded per micro-batch, and what it reads besides the
// output gets the plain model's gradients. (That it runs once per
// micro-batch, never recomputed: random_test.cpp.)

#include <ATen/record_function.h>
#include <c10/util/ScopeExit.h>
#include <c10/util/irange.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstring>
#include <map>

#include "common.h"

namespace gpipe {
namespace {

using testing::expect_same_gradients;
using testing::SeededTest;

class LossTest : public SeededTest {};

torch::nn::Sequential small_net() {
  torch::nn::Sequential net(
      torch::nn::Linear(5, 6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 4));
  net->to(torch::kFloat64);
  return net;
}

torch::Tensor cross_entropy(torch::Tensor y, torch::Tensor t) {
  return torch::nn::functional::cross_entropy(y, t);
}

TEST_F(LossTest, PlanWithLossesWhereverWrittenGivesThePlainGradients) {
  auto net = small_net();
  auto copy = testing::copy_of(net);
  GPipe model(
      copy, GPipeOptions({3, 2}).chunks(3).checkpoint(Checkpoint::Never));
  // Lane 1 runs both forwards before either loss, and the losses in
  // reverse order; lane 0's last backward waits for it all.
  const auto plan = Plan::from_csv(
      "0F0,0F1,0F2,0B2,0B1,0B0\n"
      "1F0,1F1,1L1,1F2,1L2,1L0,1B2,1B0,1B1\n");
  ASSERT_NO_THROW(plan.validate());
  auto x = torch::randn({6, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {6});
  auto expected = cross_entropy(net->forward(x), t);
  expected.backward();
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  auto got = model->train_step(x, t, cross_entropy, plan);
  model->set_trace(nullptr);
  EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12);
  expect_same_gradients(*net, *copy);
  std::string lane1;
  for (const auto& e : trace->events()) {
    if (e.lane == 1 && e.kind != TraceKind::Copy) {
      lane1 +=
          to_string(e.kind).substr(0, 1) + std::to_string(e.micro_batch) + " ";
    }
  }
  EXPECT_EQ(lane1, "f0 f1 l1 f2 l2 l0 b2 b0 b1 ");
}

TEST_F(LossTest, MakePlanListsLossesAndTheyRunThere) {
  auto net = small_net();
  GPipe model(net, GPipeOptions({2, 1, 1, 1}).chunks(4).stages_per_lane(2));
  const auto plan = make_plan(Schedule::Interleaved1F1B, 4, 2, 2);
  int64_t losses = 0;
  for (const auto& c : plan.lanes[1]) {
    losses += c.phase == Phase::Loss ? 1 : 0;
    EXPECT_TRUE(c.phase != Phase::Loss || c.partition == 3);
  }
  EXPECT_EQ(losses, 4);
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->train_step(
      torch::randn({8, 5}, torch::kFloat64),
      torch::randint(0, 4, {8}),
      cross_entropy,
      plan);
  model->set_trace(nullptr);
  int64_t traced = 0;
  for (const auto& e : trace->events()) {
    if (e.kind == TraceKind::Loss) {
      EXPECT_EQ(e.lane, 1);
      ++traced;
    }
  }
  EXPECT_EQ(traced, 4);
}

TEST_F(LossTest, RandomLossIsSeededPerMicroBatch) {
  // A loss that drops some of the output: the same seed gives the same
  // losses and gradients under any schedule and checkpoint mode, because
  // each micro-batch's loss has its own seed.
  auto dropping = [](torch::Tensor y, torch::Tensor t) {
    return cross_entropy(torch::dropout(y, 0.5, /*train=*/true), t);
  };
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {8});
  auto net = small_net();
  std::vector<torch::Tensor> reference;
  double reference_loss = 0;
  for (auto mode : {Checkpoint::Never, Checkpoint::Always}) {
    for (auto schedule :
         {Schedule::FillDrain, Schedule::OneFOneB, Schedule::ZeroBubble}) {
      auto copy = testing::copy_of(net);
      GPipe model(copy, GPipeOptions({3, 2}).chunks(4).checkpoint(mode));
      torch::manual_seed(11);
      const auto loss =
          model->train_step(x, t, dropping, schedule).item<double>();
      const auto grads = testing::grads_of(*copy);
      if (reference.empty()) {
        reference = grads;
        reference_loss = loss;
        continue;
      }
      EXPECT_DOUBLE_EQ(loss, reference_loss) << to_string(schedule);
      for (size_t k = 0; k < grads.size(); ++k) {
        // (Schedules add the micro-batches' gradients in other orders.)
        EXPECT_TRUE(torch::allclose(grads[k], reference[k], 1e-12, 1e-14))
            << to_string(schedule) << ", parameter " << k;
      }
    }
  }
  // And another seed draws other masks.
  auto copy = testing::copy_of(net);
  GPipe model(copy, GPipeOptions({3, 2}).chunks(4));
  torch::manual_seed(12);
  EXPECT_NE(model->train_step(x, t, dropping).item<double>(), reference_loss);
}

TEST_F(LossTest, WhatTheLossReadsGetsItsGradient) {
  // A loss with a learnable temperature, outside the Sequential: its
  // gradient is the plain model's, once per step.
  auto net = small_net();
  auto temperature =
      torch::full({}, 1.5, torch::kFloat64).set_requires_grad(true);
  auto scaled = [&](torch::Tensor y, torch::Tensor t) {
    return cross_entropy(y / temperature, t);
  };
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {8});
  scaled(net->forward(x), t).backward();
  const auto expected = temperature.grad().clone();
  temperature.mutable_grad().reset();
  // (Zero-bubble splits the last stage's backward, the loss's included.)
  for (auto schedule : {Schedule::OneFOneB, Schedule::ZeroBubble}) {
    for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
      SCOPED_TRACE(to_string(schedule) + ", " + to_string(mode));
      auto copy = testing::copy_of(net);
      GPipe model(copy, GPipeOptions({3, 2}).chunks(4).checkpoint(mode));
      model->train_step(x, t, scaled, schedule);
      expect_same_gradients(*net, *copy);
      ASSERT_TRUE(temperature.grad().defined());
      EXPECT_TRUE(torch::allclose(temperature.grad(), expected, 1e-10, 1e-13));
      temperature.mutable_grad().reset();
    }
  }
}

TEST_F(LossTest, AFrozenModelsLossStillTrainsWhatItReads) {
  // Calibrating a temperature on a frozen model: only the loss has a
  // learnable tensor (train_step refused such a step).
  auto net = small_net();
  for (auto& p : net->parameters()) {
    p.requires_grad_(false);
  }
  auto temperature =
      torch::full({}, 1.5, torch::kFloat64).set_requires_grad(true);
  auto scaled = [&](torch::Tensor y, torch::Tensor t) {
    return cross_entropy(y / temperature, t);
  };
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {8});
  const auto plain_loss = scaled(net->forward(x), t);
  plain_loss.backward();
  const auto expected = temperature.grad().clone();
  temperature.mutable_grad().reset();
  for (auto schedule :
       {Schedule::FillDrain, Schedule::OneFOneB, Schedule::ZeroBubble}) {
    for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
      SCOPED_TRACE(to_string(schedule) + ", " + to_string(mode));
      GPipe model(net, GPipeOptions({3, 2}).chunks(4).checkpoint(mode));
      const auto loss = model->train_step(x, t, scaled, schedule);
      EXPECT_NEAR(loss.item<double>(), plain_loss.item<double>(), 1e-12);
      ASSERT_TRUE(temperature.grad().defined());
      EXPECT_TRUE(torch::allclose(temperature.grad(), expected, 1e-10, 1e-13))
          << temperature.grad() << " against " << expected;
      temperature.mutable_grad().reset();
      for (const auto& p : net->parameters()) {
        EXPECT_FALSE(p.grad().defined());
      }
    }
  }
  // Nothing to train at all: refused as the plain model's backward is, and
  // the pipeline still trains a loss that reads the temperature afterwards.
  GPipe model(net, GPipeOptions({3, 2}).chunks(4));
  try {
    model->train_step(x, t, cross_entropy);
    ADD_FAILURE() << "no error for a step with nothing to train";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("expects something to train"),
        std::string::npos)
        << e.what();
  }
  model->train_step(x, t, scaled);
  EXPECT_TRUE(torch::allclose(temperature.grad(), expected, 1e-10, 1e-13));
}

// A last layer that cuts the output from the graph (a detach()): train_step
// refuses a loss that then requires no grad, also where every micro-batch
// is checkpointed (its loss was taken on a stand-in that requires grad:
// the step returned its loss and trained nothing); a loss that reads a
// temperature trains it alone, as the plain model's does.
TEST_F(LossTest, ACheckpointedOutputCutFromTheGraphIsToldAsAnyOther) {
  auto net = small_net();
  net->push_back(
      torch::nn::Functional([](torch::Tensor y) { return y.detach(); }));
  auto temperature =
      torch::full({}, 1.5, torch::kFloat64).set_requires_grad(true);
  auto scaled = [&](torch::Tensor y, torch::Tensor t) {
    return cross_entropy(y / temperature, t);
  };
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {8});
  scaled(net->forward(x), t).backward();
  const auto expected = temperature.grad().clone();
  temperature.mutable_grad().reset();
  for (auto schedule : {Schedule::FillDrain, Schedule::OneFOneB}) {
    for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
      SCOPED_TRACE(to_string(schedule) + ", " + to_string(mode));
      GPipe model(net, GPipeOptions({3, 3}).chunks(4).checkpoint(mode));
      try {
        model->train_step(x, t, cross_entropy, schedule);
        ADD_FAILURE() << "no error for a loss that requires no grad";
      } catch (const c10::ValueError& e) {
        EXPECT_NE(
            std::string(e.what()).find(
                "the last stage's output does not require grad"),
            std::string::npos)
            << e.what();
      }
      for (const auto& p : net->parameters()) {
        EXPECT_FALSE(p.grad().defined());
      }
      model->train_step(x, t, scaled, schedule);
      ASSERT_TRUE(temperature.grad().defined());
      EXPECT_TRUE(torch::allclose(temperature.grad(), expected, 1e-10, 1e-13));
      temperature.mutable_grad().reset();
      for (const auto& p : net->parameters()) {
        EXPECT_FALSE(p.grad().defined());
      }
    }
  }
}

// Counts the AccumulateGrad nodes that autograd runs, on any thread.
std::atomic<int64_t> accumulations{0};

std::unique_ptr<at::ObserverContext> count_accumulation(
    const at::RecordFunction& fn) {
  if (std::strstr(fn.name(), "AccumulateGrad") != nullptr) {
    ++accumulations;
  }
  return nullptr;
}

TEST_F(LossTest, TheLossJoinsTheLastStagesBackward) {
  // The loss function gets the output with a graph, as the plain model's
  // does, and the step's backward runs the plain model's nodes: no leaf for
  // the output between the loss and the stage, also where the cell is
  // checkpointed (Note [The loss and the last stage's backward]).
  auto net = small_net();
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {8});
  const auto handle =
      at::addGlobalCallback(at::RecordFunctionCallback(count_accumulation)
                                .needsInputs(false)
                                .scopes({at::RecordScope::BACKWARD_FUNCTION}));
  auto remove = c10::make_scope_exit([&] { at::removeCallback(handle); });
  for (const auto schedule : {Schedule::OneFOneB, Schedule::ZeroBubble}) {
    for (const auto mode :
         {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
      for (const int64_t chunks : {1, 4}) {
        SCOPED_TRACE(
            to_string(schedule) + ", " + to_string(mode) + ", " +
            std::to_string(chunks));
        auto plain = testing::copy_of(net);
        accumulations = 0;
        const auto xs = x.chunk(chunks);
        const auto ts = t.chunk(chunks);
        for (const auto i : c10::irange(xs.size())) {
          const auto share = static_cast<double>(xs[i].size(0)) / 8.0;
          (cross_entropy(plain->forward(xs[i]), ts[i]) * share).backward();
        }
        const int64_t expected = accumulations;
        ASSERT_GT(expected, 0);

        auto copy = testing::copy_of(net);
        GPipe model(copy, GPipeOptions({5}).chunks(chunks).checkpoint(mode));
        int64_t with_graph = 0;
        auto loss = [&](torch::Tensor y, torch::Tensor target) {
          with_graph += y.grad_fn() != nullptr ? 1 : 0;
          return cross_entropy(y, target);
        };
        accumulations = 0;
        model->train_step(x, t, loss, schedule);
        EXPECT_EQ(accumulations, expected);
        EXPECT_EQ(with_graph, chunks);
        expect_same_gradients(*plain, *copy);
      }
    }
  }
}

TEST_F(LossTest, PlansWithLossesAreChecked) {
  auto net = small_net();
  GPipe model(net, GPipeOptions({3, 2}).chunks(2));
  auto x = torch::randn({4, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {4});
  auto error_of = [&](const std::string& csv) -> std::string {
    try {
      model->train_step(x, t, cross_entropy, Plan::from_csv(csv));
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(
      error_of("0F0,0F1,0L0,0B1,0B0\n1F0,1F1,1B1,1B0\n")
          .find("losses belong to the last stage, 1"),
      std::string::npos);
  EXPECT_NE(
      error_of("0F0,0F1,0B1,0B0\n1F0,1F1,1L1,1B1,1B0\n")
          .find("L(0,1) is never run, although other losses are"),
      std::string::npos);
  const auto late = error_of("0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1L1,1L0,1B0\n");
  EXPECT_NE(late.find("deadlocks"), std::string::npos) << late;
  // The model is still usable.
  EXPECT_NO_THROW(model->train_step(x, t, cross_entropy));
}

// A loss that is not a scalar is refused saying what it was: a shape, or
// no tensor at all; the model trains afterwards.
TEST_F(LossTest, ALossThatIsNotAScalarIsRefusedSayingWhatItWas) {
  GPipe model(small_net(), GPipeOptions({3, 2}).chunks(2));
  const auto x = torch::randn({4, 5}, torch::kFloat64);
  const auto t = torch::randint(0, 4, {4});
  const auto error_of = [&](const LossFunction& loss) -> std::string {
    try {
      model->train_step(x, t, loss);
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "no ValueError";
  };
  const auto undefined =
      error_of([](torch::Tensor, torch::Tensor) { return torch::Tensor(); });
  EXPECT_NE(
      undefined.find("but it returned an undefined tensor"), std::string::npos)
      << undefined;
  const auto rows = error_of([](torch::Tensor y, torch::Tensor) { return y; });
  EXPECT_NE(rows.find("a tensor of shape [2, 4]"), std::string::npos) << rows;
  // A loss without a graph (detached, or cast to an integer dtype): the
  // plain model's backward refuses it; the step did nothing and said
  // nothing (the integer one returned a loss of 0).
  for (const auto& loss : std::vector<LossFunction>{
           [](torch::Tensor y, torch::Tensor t) {
             return cross_entropy(y, t).detach();
           },
           [](torch::Tensor y, torch::Tensor t) {
             return cross_entropy(y, t).to(torch::kLong);
           }}) {
    const auto no_graph = error_of(loss);
    EXPECT_NE(
        no_graph.find("to return a loss that requires grad"), std::string::npos)
        << no_graph;
  }
  EXPECT_NO_THROW(model->train_step(x, t, cross_entropy));
}

// A loss function that runs the backward itself: with a checkpointed last
// cell it met the junction to the output not yet recomputed, and failed
// with autograd's "Function gpipe::OutputJunction returned an invalid
// number of gradients"; without checkpoints it back-propagated into the
// last stage and train_step's own backward then failed with autograd's
// "backward through the graph a second time" (a c10::Error, not a
// ValueError), or, with retain_graph or a loss that saves nothing, added
// the last partition's gradients twice. It is told what it did, and no
// gradient reaches the model. The model stays usable.
TEST_F(LossTest, ALossThatRunsTheBackwardItselfIsToldSo) {
  const auto x = torch::randn({4, 5}, torch::kFloat64);
  const auto t = torch::randint(0, 4, {4});
  for (const auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    for (const bool retain : {false, true}) {
      GPipe model(small_net(), GPipeOptions({3, 2}).chunks(2).checkpoint(mode));
      std::string what = "no ValueError";
      try {
        model->train_step(x, t, [retain](torch::Tensor y, torch::Tensor tt) {
          auto loss = cross_entropy(y, tt);
          loss.backward({}, /*retain_graph=*/retain);
          return loss;
        });
      } catch (const c10::ValueError& e) {
        what = e.what_without_backtrace();
      }
      EXPECT_NE(
          what.find("train_step's loss_fn ran a backward through the model's "
                    "output"),
          std::string::npos)
          << to_string(mode) << (retain ? ", retained: " : ": ") << what;
      // Refused before any gradient reached the model.
      for (const auto& p : model->parameters()) {
        EXPECT_TRUE(!p.grad().defined() || p.grad().eq(0).all().item<bool>())
            << to_string(mode);
      }
      model->zero_grad();
      EXPECT_NO_THROW(model->train_step(x, t, cross_entropy));
    }
  }
}

// Where the last partition is the identity the output is that stage's
// input leaf, which the loss reads directly (or, checkpointed, through a
// junction that leads straight to its gradient): the plain gradients, the
// input's included.
TEST_F(LossTest, ALastPartitionThatIsTheIdentityPassesTheLossGradientOn) {
  for (const auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    torch::manual_seed(5);
    torch::nn::Sequential net(
        torch::nn::Linear(5, 4), torch::nn::Tanh(), torch::nn::Identity());
    net->to(torch::kFloat64);
    auto copy = testing::copy_of(net);
    GPipe model(copy, GPipeOptions({2, 1}).chunks(3).checkpoint(mode));
    const auto x = torch::randn({7, 5}, torch::kFloat64).requires_grad_(true);
    const auto x2 = x.detach().clone().requires_grad_(true);
    const auto t = torch::randint(0, 4, {7});
    cross_entropy(net->forward(x), t).backward();
    model->train_step(x2, t, cross_entropy);
    ASSERT_TRUE(x2.grad().defined()) << to_string(mode);
    EXPECT_TRUE(torch::allclose(x2.grad(), x.grad(), 1e-10, 1e-13))
        << to_string(mode);
    const auto g1 = testing::grads_of(*net);
    const auto g2 = testing::grads_of(*copy);
    for (size_t k = 0; k < g1.size(); ++k) {
      ASSERT_TRUE(g2[k].defined()) << to_string(mode) << ", parameter " << k;
      EXPECT_TRUE(torch::allclose(g2[k], g1[k], 1e-10, 1e-13))
          << to_string(mode) << ", parameter " << k;
    }
  }
}

// The guide's recipe for a loss that divides by the targets it keeps
// (cross_entropy with ignored targets, a padded language model): each
// micro-batch's sum over the batch's count, the rows' share undone. The
// plain gradients and loss, also with a micro-batch that keeps nothing
// (which the default mean makes NaN).
TEST_F(LossTest, TheGuidesRecipeForIgnoredTargetsGivesThePlainGradients) {
  namespace F = torch::nn::functional;
  const auto x = torch::randn({16, 5}, torch::kFloat64);
  const auto y = torch::tensor(
      {0, 1, 2, 1, -100, -100, -100, 0, 2, 2, 1, 0, -100, -100, -100, -100},
      torch::kLong);
  for (const auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    auto net = small_net();
    auto copy = testing::copy_of(net);
    GPipe model(copy, GPipeOptions({3, 2}).chunks(4).checkpoint(mode));
    const auto expected = F::cross_entropy(net->forward(x), y);
    expected.backward();

    const auto kept = (y != -100).sum().item<double>();
    const auto rows = static_cast<double>(y.size(0));
    const auto got =
        model->train_step(x, y, [&](torch::Tensor out, torch::Tensor t) {
          auto sum = F::cross_entropy(
              out,
              t,
              F::CrossEntropyFuncOptions().ignore_index(-100).reduction(
                  torch::kSum));
          return sum / kept * (rows / static_cast<double>(t.size(0)));
        });
    EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12)
        << to_string(mode);
    const auto g1 = testing::grads_of(*net);
    const auto g2 = testing::grads_of(*copy);
    for (size_t k = 0; k < g1.size(); ++k) {
      EXPECT_TRUE(torch::allclose(g2[k], g1[k], 1e-10, 1e-13))
          << to_string(mode) << ", parameter " << k;
    }
  }
}

// The guide's advice for a model whose output the loss flattens (a
// [B, T, V] output against a [B, T] target): train_step cuts both by the
// batch, and the loss flattens them; the plain model's gradients.
TEST_F(LossTest, ALossThatFlattensTheOutputAndTargetGivesThePlainGradients) {
  const auto make = [] {
    torch::manual_seed(3);
    torch::nn::Sequential net(
        torch::nn::Linear(5, 6), torch::nn::Tanh(), torch::nn::Linear(6, 4));
    net->to(torch::kFloat64);
    return net;
  };
  const auto x = torch::randn({6, 3, 5}, torch::kFloat64);
  const auto t = torch::randint(0, 4, {6, 3});
  const auto flat = [](torch::Tensor y, torch::Tensor target) {
    return cross_entropy(y.reshape({-1, y.size(-1)}), target.reshape({-1}));
  };
  auto plain = make();
  const auto expected = flat(plain->forward(x), t);
  expected.backward();
  auto net = make();
  GPipe model(net, GPipeOptions({2, 1}).chunks(4));
  const auto loss = model->train_step(x, t, flat);
  EXPECT_TRUE(torch::allclose(loss, expected, 1e-12, 0));
  expect_same_gradients(*plain, *net);
}

}  // namespace
}  // namespace gpipe
