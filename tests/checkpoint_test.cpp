// Checkpointing through GPipe: which runs are checkpointed, the inspection
// flags, random streams replayed in recomputation, and side effects kept
// single.

#include <atomic>
#include <mutex>

#include "common.h"
#include "error_of.h"

namespace {

using gpipe::Checkpoint;
using gpipe::testing::lambda;
using gpipe::testing::SeededTest;

class CheckpointTest : public SeededTest {};

// Counts forward runs of one layer, split by is_checkpointing/is_recomputing.
struct Counts {
  std::atomic<int> plain{0};
  std::atomic<int> checkpointing{0};
  std::atomic<int> recomputing{0};
};

torch::nn::Sequential counted(Counts& counts) {
  auto count = lambda([&counts](torch::Tensor x) {
    if (gpipe::is_checkpointing()) {
      ++counts.checkpointing;
    } else if (gpipe::is_recomputing()) {
      ++counts.recomputing;
    } else {
      ++counts.plain;
    }
    return x;
  });
  return torch::nn::Sequential(torch::nn::Linear(2, 2), count);
}

TEST_F(CheckpointTest, ModesCheckpointTheRightMicroBatches) {
  struct Expect {
    Checkpoint mode;
    int checkpointed;
  };
  for (auto e :
       {Expect{Checkpoint::Always, 4},
        Expect{Checkpoint::ExceptLast, 3},
        Expect{Checkpoint::Never, 0}}) {
    Counts counts;
    gpipe::GPipe model(
        counted(counts),
        gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(e.mode));
    model->forward(torch::randn({8, 2})).sum().backward();
    EXPECT_EQ(counts.checkpointing.load(), e.checkpointed);
    EXPECT_EQ(counts.recomputing.load(), e.checkpointed);
    EXPECT_EQ(counts.plain.load(), 4 - e.checkpointed);
  }
}

TEST_F(CheckpointTest, ChunksOneConstructsInEveryMode) {
  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    Counts counts;
    gpipe::GPipe model(
        counted(counts), gpipe::GPipeOptions({2}).checkpoint(mode));
    model->forward(torch::randn({3, 2})).sum().backward();
    EXPECT_EQ(counts.recomputing.load(), mode == Checkpoint::Always ? 1 : 0);
  }
}

TEST_F(CheckpointTest, EvalNeverCheckpoints) {
  Counts counts;
  gpipe::GPipe model(
      counted(counts),
      gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(Checkpoint::Always));
  model->eval();
  auto x = torch::randn({8, 2}, torch::requires_grad());
  model->forward(x).sum().backward();
  EXPECT_EQ(counts.checkpointing.load(), 0);
  EXPECT_EQ(counts.recomputing.load(), 0);
  EXPECT_EQ(counts.plain.load(), 4);
}

// eval() on the user's Sequential reaches the layers, not the GPipe's own
// flag: the pass follows the layers. It used to checkpoint, running each
// layer twice in eval mode. One layer put back in training mode (MC
// dropout) makes the pass train again.
TEST_F(CheckpointTest, EvalOnTheGivenSequentialNeverCheckpoints) {
  Counts counts;
  auto net = counted(counts);
  gpipe::GPipe model(
      net,
      gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(Checkpoint::Always));
  net->eval();
  auto x = torch::randn({8, 2}, torch::requires_grad());
  model->forward(x).sum().backward();
  EXPECT_EQ(counts.checkpointing.load(), 0);
  EXPECT_EQ(counts.recomputing.load(), 0);
  EXPECT_EQ(counts.plain.load(), 4);
  net[1]->train();
  model->forward(x).sum().backward();
  EXPECT_EQ(counts.checkpointing.load(), 4);
  EXPECT_EQ(counts.recomputing.load(), 4);
}

TEST_F(CheckpointTest, NoGradBuildsNoGraphAndNeverCheckpoints) {
  Counts counts;
  gpipe::GPipe model(
      counted(counts),
      gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(Checkpoint::Always));
  torch::NoGradGuard no_grad;
  auto y = model->forward(torch::randn({8, 2}));
  EXPECT_FALSE(y.requires_grad());
  EXPECT_FALSE(y.grad_fn());
  EXPECT_EQ(counts.checkpointing.load(), 0);
}

// LibTorch runs a backward called inside c10::InferenceMode (the plain
// model's gradients are right); the recomputation ran in InferenceMode
// too, made tensors without a graph, and left the checkpointed
// micro-batches without gradients: none with Always, only the last
// micro-batch's with ExceptLast, and no error.
TEST_F(CheckpointTest, ABackwardInsideInferenceModeRecomputesWithAGraph) {
  for (const auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    SCOPED_TRACE(gpipe::to_string(mode));
    auto make = [] {
      torch::manual_seed(1);
      torch::nn::Sequential net(
          torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
      net->to(torch::kDouble);
      return net;
    };
    auto net = make();
    auto plain = make();
    gpipe::GPipe model(
        net, gpipe::GPipeOptions({2, 1}).chunks(3).checkpoint(mode));
    const auto x = torch::randn({6, 4}, torch::kDouble);
    auto loss = model->forward(x).pow(2).sum();
    auto expected = plain->forward(x).pow(2).sum();
    {
      c10::InferenceMode inference;
      expected.backward();
      loss.backward();
    }
    for (size_t k = 0; k < net->parameters().size(); ++k) {
      const auto& got = net->parameters()[k].grad();
      ASSERT_TRUE(got.defined()) << "parameter " << k;
      EXPECT_TRUE(
          torch::allclose(got, plain->parameters()[k].grad(), 1e-12, 1e-12))
          << "parameter " << k;
    }
  }
}

TEST_F(CheckpointTest, FlagsAreFalseOutsideCheckpointing) {
  EXPECT_FALSE(gpipe::is_checkpointing());
  EXPECT_FALSE(gpipe::is_recomputing());
  {
    gpipe::detail::CheckpointingGuard guard;
    EXPECT_TRUE(gpipe::is_checkpointing());
  }
  EXPECT_FALSE(gpipe::is_checkpointing());
}

// torchgpipe's test_parallel_randoms: dropout everywhere, every micro-batch
// checkpointed; the recomputed masks must equal the forward's, so the zero
// pattern of the output is the zero pattern of the input gradient.
TEST_F(CheckpointTest, DropoutMasksReplayInRecomputation) {
  for (int trial = 0; trial < 10; ++trial) {
    torch::nn::Sequential net;
    for (int k = 0; k < 40; ++k) {
      net->push_back(torch::nn::Dropout(0.1));
    }
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({10, 10, 10, 10})
            .chunks(10)
            .checkpoint(Checkpoint::Always));
    auto x = torch::ones({20, 8}, torch::requires_grad());
    auto y = model->forward(x);
    y.norm().backward();
    EXPECT_TRUE(torch::equal(y.eq(0), x.grad().eq(0))) << "trial " << trial;
    EXPECT_TRUE(y.eq(0).any().item<bool>());
  }
}

TEST_F(CheckpointTest, RandomLayersAreDeterministicGivenTheSeed) {
  auto run = [] {
    torch::manual_seed(7);
    torch::nn::Sequential net(
        torch::nn::Linear(4, 4),
        torch::nn::Dropout(0.5),
        torch::nn::Linear(4, 4),
        torch::nn::Dropout(0.5));
    gpipe::GPipe model(net, gpipe::GPipeOptions({2, 2}).chunks(4));
    auto y = model->forward(torch::ones({16, 4}));
    y.sum().backward();
    return std::make_pair(
        y.detach(), net[0]->as<torch::nn::Linear>()->weight.grad().clone());
  };
  auto a = run();
  for (int k = 0; k < 5; ++k) {
    auto b = run();
    EXPECT_TRUE(torch::equal(a.first, b.first));
    EXPECT_TRUE(torch::equal(a.second, b.second));
  }
}

TEST_F(CheckpointTest, DropoutGradientsEqualUncheckpointedRun) {
  // Same seed, same masks: Always and Never give the same gradients.
  auto grads = [](Checkpoint mode) {
    torch::manual_seed(3);
    torch::nn::Sequential net(
        torch::nn::Linear(4, 8),
        torch::nn::Dropout(0.5),
        torch::nn::Linear(8, 4),
        torch::nn::Dropout(0.5));
    net->to(torch::kDouble);
    gpipe::GPipe model(
        net, gpipe::GPipeOptions({2, 2}).chunks(3).checkpoint(mode));
    auto x = torch::randn({6, 4}, torch::kDouble).requires_grad_(true);
    model->forward(x).pow(2).sum().backward();
    return x.grad().clone();
  };
  EXPECT_TRUE(torch::allclose(
      grads(Checkpoint::Always), grads(Checkpoint::Never), 1e-10, 1e-12));
}

TEST_F(CheckpointTest, UserRandomStreamOnlyAdvancesByTheStepSeed) {
  // Layers that draw must not leave the generator at a cell seed: two
  // forwards in a row see different masks.
  torch::nn::Sequential net(torch::nn::Dropout(0.5), torch::nn::Dropout(0.5));
  gpipe::GPipe model(net, gpipe::GPipeOptions({1, 1}).chunks(2));
  auto a = model->forward(torch::ones({64, 8}));
  auto b = model->forward(torch::ones({64, 8}));
  EXPECT_FALSE(torch::equal(a, b));
}

// A layer that changes a checkpointed partition's input in place: the
// recomputation would read the changed input and change it again, and
// the gradients were silently wrong (off by 0.3 here). It is refused; out
// of place, or without checkpointing, the gradients are the plain model's.
TEST_F(CheckpointTest, AnInputChangedInPlaceIsRefusedBeforeTheRecomputation) {
  const auto doubling = [](bool in_place) {
    return lambda(
        [in_place](torch::Tensor x) { return in_place ? x.mul_(2) : x * 2; });
  };
  const auto net_with = [&](bool in_place) {
    torch::manual_seed(0);
    return torch::nn::Sequential(
        doubling(in_place),
        torch::nn::Linear(8, 4),
        torch::nn::Tanh(),
        torch::nn::Linear(4, 3));
  };
  for (const auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
    for (const int64_t chunks : {1, 2}) {
      if (mode == Checkpoint::ExceptLast && chunks == 1) {
        continue;  // nothing checkpointed
      }
      auto net = net_with(true);
      net->to(torch::kFloat64);
      gpipe::GPipe model(
          net, gpipe::GPipeOptions({2, 2}).chunks(chunks).checkpoint(mode));
      auto x = torch::ones({4, 8}, torch::kFloat64);
      auto loss = model->forward(x).sum();
      try {
        loss.backward();
        ADD_FAILURE() << "no error, chunks " << chunks;
      } catch (const c10::ValueError& e) {
        EXPECT_NE(
            std::string(e.what_without_backtrace())
                .find("a checkpointed partition's input was changed in place"),
            std::string::npos)
            << e.what_without_backtrace();
      }
      // The model is usable afterwards.
      model->zero_grad();
      EXPECT_NO_THROW(model->forward(torch::ones({4, 8}, torch::kFloat64)));
    }
  }
  // Out of place, checkpointed: the plain model's gradients.
  auto plain = net_with(false);
  plain->to(torch::kFloat64);
  auto checkpointed = net_with(false);
  checkpointed->to(torch::kFloat64);
  gpipe::GPipe model(
      checkpointed,
      gpipe::GPipeOptions({2, 2}).chunks(2).checkpoint(Checkpoint::Always));
  const auto x = torch::randn({4, 8}, torch::kFloat64);
  plain->forward(x).sum().backward();
  model->forward(x).sum().backward();
  const auto a = plain->parameters();
  const auto b = model->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_TRUE(torch::allclose(a[k].grad(), b[k].grad(), 0, 1e-12)) << k;
  }
}

// A parameter changed in place between the forward and the backward (an
// optimizer's step under NoGradGuard): the plain model's backward refuses
// it (a tensor it saved changed), and so did GPipe's uncheckpointed cells,
// but a checkpointed cell recomputed with the new weights and gave wrong
// gradients without a word. A frozen parameter counts: it shapes the
// gradient of the input.
TEST_F(
    CheckpointTest, AParameterChangedInPlaceIsRefusedBeforeTheRecomputation) {
  for (const bool frozen : {false, true}) {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(
        torch::nn::Linear(6, 5),
        torch::nn::Tanh(),
        torch::nn::Linear(5, 4),
        torch::nn::Tanh(),
        torch::nn::Linear(4, 2));
    net->to(torch::kFloat64);
    auto changed = net->named_parameters()["2.weight"];
    changed.set_requires_grad(!frozen);
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({2, 2, 1}).chunks(4).checkpoint(
            Checkpoint::Always));
    const auto x = torch::randn({8, 6}, torch::kFloat64);
    auto loss = model->forward(x).pow(2).sum();
    {
      torch::NoGradGuard no_grad;
      changed.add_(0.5);
    }
    try {
      loss.backward();
      ADD_FAILURE() << "no error, frozen " << frozen;
    } catch (const c10::ValueError& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(
          what.find("a parameter of a checkpointed partition ('2.weight', of "
                    "shape [4, 5]) was changed in place after the partition's "
                    "forward"),
          std::string::npos)
          << what;
      EXPECT_NE(what.find("gpipe partition 1"), std::string::npos) << what;
    }
    // Usable afterwards: the next pass has the plain model's gradients.
    model->zero_grad();
    auto plain = torch::nn::Sequential();
    for (const auto& layer : *net) {
      plain->push_back(layer);
    }
    plain->forward(x).pow(2).sum().backward();
    std::vector<torch::Tensor> expected;
    for (const auto& p : model->parameters()) {
      expected.push_back(p.grad().defined() ? p.grad().clone() : p.grad());
    }
    model->zero_grad();
    model->forward(x).pow(2).sum().backward();
    const auto params = model->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      ASSERT_EQ(params[k].grad().defined(), expected[k].defined()) << k;
      if (expected[k].defined()) {
        EXPECT_TRUE(torch::allclose(params[k].grad(), expected[k], 0, 1e-12))
            << k;
      }
    }
  }
}

// LibTorch's SGD writes its step through p.data(), whose version counter is
// not the parameter's: an optimizer.step() between the forward and the
// backward left every counter as it was, and the checkpointed cells
// recomputed with the new weights (gradients 0.2 off the plain model's)
// without a word. Refused too; a step after the backward, as every
// training loop does it, is not.
TEST_F(CheckpointTest, AnSgdStepBeforeTheBackwardIsRefused) {
  for (const auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(
        torch::nn::Linear(6, 5),
        torch::nn::Tanh(),
        torch::nn::Linear(5, 4),
        torch::nn::Tanh());
    net->to(torch::kFloat64);
    gpipe::GPipe model(
        net, gpipe::GPipeOptions({2, 2}).chunks(2).checkpoint(mode));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    const auto x = torch::randn({4, 6}, torch::kFloat64);
    for (int step = 0; step < 3; ++step) {
      sgd.zero_grad();
      model->forward(x).pow(2).sum().backward();
      sgd.step();
    }
    sgd.zero_grad();
    auto loss = model->forward(x).pow(2).sum();
    model->forward(x).sum().backward();  // gradients for the step
    sgd.step();
    try {
      loss.backward();
      ADD_FAILURE() << "no error, mode " << static_cast<int>(mode);
    } catch (const c10::ValueError& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(
          what.find("a parameter of a checkpointed partition ('2.weight', of "
                    "shape [4, 5]) was changed after the partition's forward "
                    "(its values changed, its version did not:"),
          std::string::npos)
          << what;
    }
  }
}

// A layer that changes its own weights as it runs (an Embedding with
// max_norm renormalises them in place in every forward) is not refused: its
// changes are the layers' own, and recomputation reads what it left; with
// Always, an eval pass between the forward and the backward counts as the
// layers' own too (with ExceptLast, the last micro-batch's saved weight
// would be refused by LibTorch's own check, as the plain model's). The
// gradients are the plain model's.
TEST_F(CheckpointTest, ALayerThatRenormalisesItsWeightsIsNotRefused) {
  const auto make = [] {
    torch::manual_seed(5);
    torch::nn::Sequential net(
        torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).max_norm(0.5)),
        torch::nn::Flatten(),
        torch::nn::Linear(12, 3));
    net->to(torch::kFloat64);
    return net;
  };
  const auto x = torch::randint(0, 10, {8, 3});
  for (const auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
    auto plain = make();
    auto net = make();
    gpipe::GPipe model(
        net, gpipe::GPipeOptions({1, 2}).chunks(4).checkpoint(mode));
    auto loss = model->forward(x).pow(2).sum();
    if (mode == Checkpoint::Always) {
      torch::NoGradGuard no_grad;
      model->eval();
      model->forward(x);
      model->train();
    }
    EXPECT_NO_THROW(loss.backward());
    plain->forward(x).pow(2).sum().backward();
    gpipe::testing::expect_same_gradients(*plain, *net);
  }
}

TEST_F(CheckpointTest, RecomputationUpdatesRunningStatisticsOnce) {
  auto stats = [](Checkpoint mode) {
    torch::manual_seed(1);
    torch::nn::Sequential net(
        torch::nn::Linear(3, 4),
        torch::nn::BatchNorm1d(4),
        torch::nn::Linear(4, 2));
    gpipe::GPipe model(
        net, gpipe::GPipeOptions({2, 1}).chunks(2).checkpoint(mode));
    for (int k = 0; k < 3; ++k) {
      model->forward(torch::randn({8, 3})).sum().backward();
    }
    auto bn = net[1]->as<torch::nn::BatchNorm1d>();
    return std::make_pair(
        bn->running_mean.clone(), bn->num_batches_tracked.item<int64_t>());
  };
  auto always = stats(Checkpoint::Always);
  auto never = stats(Checkpoint::Never);
  EXPECT_EQ(always.second, 6);
  EXPECT_EQ(never.second, 6);
  EXPECT_TRUE(torch::allclose(always.first, never.first));
}

// A layer that reads a buffer and then updates it in its forward (a
// running average it scales by): the recomputation must read the buffer as
// the forward did, not as later forwards left it (Note [Buffers a forward
// changes]). Gradients and buffers are the plain model's, run micro-batch
// by micro-batch, with checkpoints, through forward and train_step, over
// steps (a buffer beside it that never changes is read as it is).
TEST_F(CheckpointTest, ABufferALayerReadsThenUpdatesIsRecomputedAsItWasRead) {
  struct ScaleByRunningImpl : torch::nn::Module {
    torch::Tensor running;
    torch::Tensor fixed;
    ScaleByRunningImpl() {
      running = register_buffer("running", torch::ones({6}, torch::kDouble));
      fixed = register_buffer("fixed", torch::full({6}, 0.5, torch::kDouble));
    }
    torch::Tensor forward(torch::Tensor x) {
      auto y = x * running.clone() * fixed;  // (saved: not the buffer)
      torch::NoGradGuard no_grad;
      running.mul_(0.5).add_(x.mean(0).abs());
      return y;
    }
  };
  const auto make = [] {
    torch::manual_seed(3);
    torch::nn::Sequential net(
        torch::nn::Linear(6, 6),
        std::make_shared<ScaleByRunningImpl>(),
        torch::nn::Tanh(),
        torch::nn::Linear(6, 2));
    net->to(torch::kDouble);
    return net;
  };
  const auto x = torch::randn({8, 6}, torch::kDouble);
  for (const int64_t chunks : {1, 2, 4}) {
    for (const auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
      for (const bool by_step : {false, true}) {
        auto plain = make();
        auto net = make();
        gpipe::GPipe model(
            net, gpipe::GPipeOptions({2, 2}).chunks(chunks).checkpoint(mode));
        for (int step = 0; step < 2; ++step) {
          plain->zero_grad();
          net->zero_grad();
          for (const auto& part : x.chunk(chunks)) {
            plain->forward(part).pow(2).sum().backward();
          }
          if (by_step) {
            model->train_step(
                x,
                torch::zeros({8}),
                [](const torch::Tensor& out, const torch::Tensor&) {
                  return out.pow(2).sum();
                },
                gpipe::Schedule::OneFOneB);
            // (train_step's loss is scaled by each micro-batch's share.)
            for (auto& p : net->parameters()) {
              p.mutable_grad().mul_(chunks);
            }
          } else {
            model->forward(x).pow(2).sum().backward();
          }
          SCOPED_TRACE(c10::str(
              "chunks ",
              chunks,
              ", ",
              to_string(mode),
              by_step ? ", train_step" : ", forward",
              ", step ",
              step));
          gpipe::testing::expect_same_gradients(*plain, *net);
          const auto buffers = net->buffers();
          const auto expected = plain->buffers();
          ASSERT_EQ(buffers.size(), expected.size());
          for (const auto k : c10::irange(buffers.size())) {
            EXPECT_TRUE(torch::allclose(buffers[k], expected[k], 1e-12, 1e-12));
          }
        }
      }
    }
  }
}

// A last layer that cuts the graph (a detach()) leaves the plain model's
// output needing no grad, and its backward() fails. A checkpointed
// micro-batch's output is computed without a graph, so it cannot tell and
// says it needs grad until the backward recomputes it: that backward then
// fails too, rather than returning having trained nothing. An output cut
// beside one that is not is left out of the backward, as in the plain
// model, and the model stays usable after the failure.
TEST_F(CheckpointTest, ABackwardThroughACutOutputFailsAsThePlainModelsDoes) {
  struct CutHeadImpl : torch::nn::Module {
    std::vector<torch::Tensor> forward(torch::Tensor x) {
      return {x * 2, x.detach()};
    }
  };
  torch::manual_seed(0);
  auto cut = lambda([](torch::Tensor x) { return x.detach(); });
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Tanh(), cut);
  net->to(torch::kDouble);
  const auto x = torch::randn({6, 4}, torch::kDouble);
  EXPECT_THROW(net->forward(x).sum().backward(), c10::Error);
  for (const auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
    for (const auto& balance :
         {std::vector<int64_t>{1, 2}, std::vector<int64_t>{3}}) {
      gpipe::GPipe model(
          net, gpipe::GPipeOptions(balance).chunks(2).checkpoint(mode));
      auto out = model->forward(x);
      const auto message =
          gpipe::testing::error_of([&] { out.sum().backward(); });
      EXPECT_NE(message.find("recomputed"), std::string::npos)
          << to_string(mode) << ": " << message;
      EXPECT_FALSE(net[0]->as<torch::nn::Linear>()->weight.grad().defined());
    }
  }

  torch::manual_seed(0);
  torch::nn::Sequential tuple_net(
      torch::nn::Linear(4, 4), std::make_shared<CutHeadImpl>());
  tuple_net->to(torch::kDouble);
  auto plain = tuple_net->forward<std::vector<torch::Tensor>>(x);
  (plain[0].sum() + plain[1].sum()).backward();
  const auto weight = tuple_net[0]->as<torch::nn::Linear>()->weight;
  const auto expected = weight.grad().clone();
  weight.mutable_grad().reset();
  gpipe::GPipe model(
      tuple_net,
      gpipe::GPipeOptions({1, 1}).chunks(3).checkpoint(Checkpoint::Always));
  auto only_cut = model->forward_tuple(x);
  const auto message =
      gpipe::testing::error_of([&] { only_cut[1].sum().backward(); });
  EXPECT_NE(message.find("recomputed"), std::string::npos) << message;
  auto out = model->forward_tuple(x);
  (out[0].sum() + out[1].sum()).backward();
  ASSERT_TRUE(weight.grad().defined());
  EXPECT_TRUE(torch::allclose(weight.grad(), expected, 1e-12, 1e-12));
}

}  // namespace
