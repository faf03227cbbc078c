// GPipe against the plain Sequential: outputs and every gradient, over a
// table of models x balance x chunks x checkpoint modes, in float64.

#include <torch/cuda.h>

#include <functional>
#include <sstream>

#include "common.h"

namespace {

using gpipe::Checkpoint;
using gpipe::testing::copy_of;
using gpipe::testing::grads_of;
using gpipe::testing::SeededTest;

class TransparencyTest : public SeededTest {};

torch::nn::Sequential linears(int64_t layers) {
  torch::nn::Sequential net;
  for (int64_t k = 0; k < layers; ++k) {
    net->push_back(torch::nn::Linear(6, 6));
    if (k + 1 < layers) {
      net->push_back(torch::nn::Tanh());
    }
  }
  return net;
}

torch::nn::Sequential convnet() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)),
      torch::nn::ReLU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)),
      torch::nn::ReLU(),
      torch::nn::Flatten(),
      torch::nn::Linear(4 * 5 * 5, 3));
}

struct Case {
  std::string model;
  std::vector<int64_t> balance;
  int64_t chunks;
  Checkpoint checkpoint;
  int64_t batch;
};

void expect_close(
    const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) {
    return;
  }
  EXPECT_TRUE(torch::allclose(a, b, /*rtol=*/1e-10, /*atol=*/1e-12))
      << what << ": max difference " << (a - b).abs().max().item<double>();
}

TEST_F(TransparencyTest, OutputsAndGradientsEqualThePlainSequential) {
  std::vector<Case> cases;
  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    for (int64_t chunks : {1, 2, 3, 4, 8}) {
      // 7 layers: Linear, Tanh, ... Linear.
      for (auto balance : std::vector<std::vector<int64_t>>{
               {7}, {3, 4}, {1, 6}, {2, 2, 3}, {1, 1, 1, 4}}) {
        cases.push_back({"linears", balance, chunks, mode, 7});
      }
      cases.push_back({"conv", {2, 4}, chunks, mode, 5});
      cases.push_back({"conv", {1, 2, 3}, chunks, mode, 3});
    }
  }
  for (const auto& c : cases) {
    std::ostringstream name;
    name << c.model << " balance=" << c10::IntArrayRef(c.balance)
         << " chunks=" << c.chunks
         << " checkpoint=" << gpipe::to_string(c.checkpoint)
         << " batch=" << c.batch;
    SCOPED_TRACE(name.str());
    auto plain = c.model == "linears" ? linears(4) : convnet();
    plain->to(torch::kDouble);
    auto net = copy_of(plain);
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions(c.balance).chunks(c.chunks).checkpoint(
            c.checkpoint));

    auto x = c.model == "linears"
                 ? torch::randn({c.batch, 6}, torch::kDouble)
                 : torch::randn({c.batch, 2, 5, 5}, torch::kDouble);
    auto x1 = x.clone().requires_grad_(true);
    auto x2 = x.clone().requires_grad_(true);
    auto y1 = plain->forward(x1);
    auto y2 = model->forward(x2);
    expect_close(y1, y2, "output");
    // A loss that weights every output element differently.
    auto w = torch::randn_like(y1);
    (y1 * w).sum().backward();
    (y2 * w).sum().backward();
    expect_close(x1.grad(), x2.grad(), "input grad");
    auto g1 = grads_of(*plain);
    auto g2 = grads_of(*model);
    ASSERT_EQ(g1.size(), g2.size());
    for (size_t k = 0; k < g1.size(); ++k) {
      expect_close(g1[k], g2[k], "parameter " + std::to_string(k));
    }
  }
}

// A model put in eval() between forward() and loss.backward(): the plain
// model back-propagates through the graph its forward recorded in training
// mode, and so does GPipe, whose checkpointed cells recompute in the modes
// their forward ran in (BatchNorm on the micro-batch's statistics, Dropout
// with its mask) and are left in eval() afterwards. With BatchNorm (plain
// and deferred) against the plain model at chunks 1; with Dropout against
// the same GPipe step without the switch.
TEST_F(TransparencyTest, EvalBeforeBackwardRecomputesInTheForwardsModes) {
  auto batch_norms = [] {
    torch::nn::Sequential net(
        torch::nn::Linear(6, 8),
        torch::nn::BatchNorm1d(8),
        torch::nn::Tanh(),
        torch::nn::Linear(8, 8),
        torch::nn::BatchNorm1d(8),
        torch::nn::Linear(8, 2));
    net->to(torch::kDouble);
    for (const auto k : {1, 4}) {
      // Running statistics far from the batch's: eval() shows at once.
      net[k]->named_buffers()["running_mean"].fill_(3.0);
    }
    return net;
  };
  const auto x = torch::randn({9, 6}, torch::kDouble);
  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    for (bool deferred : {false, true}) {
      for (bool through_net : {false, true}) {
        SCOPED_TRACE(
            gpipe::to_string(mode) + (deferred ? " deferred" : "") +
            (through_net ? ", net->eval()" : ", model->eval()"));
        auto plain = batch_norms();
        auto net = copy_of(plain);
        gpipe::GPipe model(
            net,
            gpipe::GPipeOptions({3, 3})
                .chunks(1)
                .checkpoint(mode)
                .deferred_batch_norm(deferred));
        auto y1 = plain->forward(x);
        auto y2 = model->forward(x);
        plain->eval();
        if (through_net) {
          net->eval();
        } else {
          model->eval();
        }
        y1.pow(2).sum().backward();
        y2.pow(2).sum().backward();
        gpipe::testing::expect_same_gradients(*plain, *model);
        // Left in eval(), with the statistics of one forward.
        EXPECT_FALSE(net[1]->is_training());
        EXPECT_FALSE(net[4]->is_training());
        expect_close(
            net[4]->named_buffers()["running_mean"],
            plain[4]->named_buffers()["running_mean"],
            "running mean");
        expect_close(model->forward(x), plain->forward(x), "eval output");
      }
    }
  }
  auto dropouts = [] {
    torch::nn::Sequential net(
        torch::nn::Linear(6, 8),
        torch::nn::Dropout(0.5),
        torch::nn::Tanh(),
        torch::nn::Linear(8, 8),
        torch::nn::Dropout(0.3),
        torch::nn::Linear(8, 2));
    net->to(torch::kDouble);
    return net;
  };
  for (auto mode : {Checkpoint::Always, Checkpoint::ExceptLast}) {
    SCOPED_TRACE(gpipe::to_string(mode) + ", dropout");
    auto base = dropouts();
    std::vector<std::vector<torch::Tensor>> grads;
    for (bool switch_modes : {false, true}) {
      auto net = copy_of(base);
      gpipe::GPipe model(
          net, gpipe::GPipeOptions({3, 3}).chunks(3).checkpoint(mode));
      torch::manual_seed(7);
      auto y = model->forward(x);
      if (switch_modes) {
        model->eval();
      }
      y.pow(2).sum().backward();
      grads.push_back(gpipe::testing::grads_of(*model));
      EXPECT_EQ(model->is_training(), !switch_modes);
    }
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t k = 0; k < grads[0].size(); ++k) {
      expect_close(grads[0][k], grads[1][k], "parameter " + std::to_string(k));
    }
  }
}

TEST_F(TransparencyTest, Float32GradientsWithinRelativeTolerance) {
  auto plain = linears(4);
  auto net = copy_of(plain);
  gpipe::GPipe model(net, gpipe::GPipeOptions({3, 4}).chunks(4));
  auto x = torch::randn({16, 6});
  plain->forward(x).pow(2).sum().backward();
  model->forward(x).pow(2).sum().backward();
  auto g1 = grads_of(*plain);
  auto g2 = grads_of(*model);
  for (size_t k = 0; k < g1.size(); ++k) {
    EXPECT_TRUE(torch::allclose(g1[k], g2[k], 1e-5, 1e-6)) << k;
  }
}

TEST_F(TransparencyTest, FiveSgdStepsEqualThePlainModel) {
  auto plain = convnet();
  plain->to(torch::kDouble);
  auto net = copy_of(plain);
  gpipe::GPipe model(
      net,
      gpipe::GPipeOptions({3, 3}).chunks(4).checkpoint(Checkpoint::Always));
  torch::optim::SGD opt1(
      plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD opt2(
      model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({8, 2, 5, 5}, torch::kDouble);
    auto target = torch::randint(0, 3, {8});
    opt1.zero_grad();
    opt2.zero_grad();
    auto l1 = torch::nn::functional::cross_entropy(plain->forward(x), target);
    auto l2 = torch::nn::functional::cross_entropy(model->forward(x), target);
    EXPECT_NEAR(l1.item<double>(), l2.item<double>(), 1e-10) << "step " << step;
    l1.backward();
    l2.backward();
    opt1.step();
    opt2.step();
  }
  auto p1 = plain->parameters();
  auto p2 = model->parameters();
  for (size_t k = 0; k < p1.size(); ++k) {
    expect_close(p1[k], p2[k], "parameter " + std::to_string(k));
  }
}

TEST_F(TransparencyTest, OnlyParametersRequireGrad) {
  auto plain = linears(3);
  plain->to(torch::kDouble);
  auto net = copy_of(plain);
  gpipe::GPipe model(net, gpipe::GPipeOptions({2, 3}).chunks(3));
  auto x = torch::randn({6, 6}, torch::kDouble);
  auto y = model->forward(x);
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  plain->forward(x).sum().backward();
  auto g1 = grads_of(*plain);
  auto g2 = grads_of(*model);
  for (size_t k = 0; k < g1.size(); ++k) {
    expect_close(g1[k], g2[k], "parameter " + std::to_string(k));
  }
}

}  // namespace

namespace {

// Needs a CUDA device: skipped on CPU-only machines (CI), run on a GPU host.
TEST_F(TransparencyTest, CudaPartitionsEqualThePlainSequential_CUDA) {
  if (!torch::cuda::is_available()) {
    // Skipped: needs a CUDA device (CPU-only machines and CI)
    GTEST_SKIP() << "needs a CUDA device";  // CPU-only machines and CI
  }
  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    auto plain = linears(4);
    plain->to(torch::kDouble);
    auto net = copy_of(plain);
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({3, 4})
            .devices({torch::Device("cuda:0"), torch::Device("cuda:0")})
            .chunks(3)
            .checkpoint(mode));
    auto x = torch::randn({7, 6}, torch::kDouble);
    auto x1 = x.clone().requires_grad_(true);
    auto x2 = x.clone().requires_grad_(true);
    auto y1 = plain->forward(x1);
    auto y2 = model->forward(x2);
    ASSERT_TRUE(y2.is_cuda());
    expect_close(y1, y2.cpu(), "output");
    y1.pow(2).sum().backward();
    y2.pow(2).sum().backward();
    expect_close(x1.grad(), x2.grad(), "input grad");
    auto g1 = grads_of(*plain);
    auto g2 = grads_of(*model);
    for (size_t k = 0; k < g1.size(); ++k) {
      expect_close(g1[k], g2[k].cpu(), "parameter " + std::to_string(k));
    }
  }
}

}  // namespace
