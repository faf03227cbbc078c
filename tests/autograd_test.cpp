// The pipeline as autograd sees it: output gradients cut by the real output
// sizes, backward(create_graph) refused, frozen layers left alone, and
// boundary tensors that require grad exactly where the plain model's do.

#include <atomic>

#include "common.h"

namespace {

using gpipe::Checkpoint;
using gpipe::testing::SeededTest;

class AutogradTest : public SeededTest {};

void expect_grads_equal(
    const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].defined(), b[k].defined()) << "parameter " << k;
    if (a[k].defined()) {
      EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-10, 1e-12))
          << "parameter " << k;
    }
  }
}

// A sequence model whose last layer flattens [B, T, V] logits into
// [B*T, V] for cross_entropy: the output has more rows than the input.
torch::nn::Sequential sequence_model() {
  torch::manual_seed(5);
  torch::nn::Sequential net(
      torch::nn::Linear(4, 6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 5),
      gpipe::testing::lambda([](torch::Tensor x) {
        return x.reshape({-1, x.size(-1)});
      }));
  net->to(torch::kFloat64);
  return net;
}

TEST_F(AutogradTest, LastLayerThatChangesTheBatchDimension) {
  auto x = torch::randn({7, 3, 4}, torch::kFloat64);  // B=7, T=3
  auto y = torch::randint(5, {21}, torch::kLong);
  auto plain = sequence_model();
  auto xp = x.clone().requires_grad_(true);
  torch::nn::functional::cross_entropy(plain->forward(xp), y).backward();

  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    gpipe::GPipe model(
        sequence_model(),
        gpipe::GPipeOptions({2, 2}).chunks(3).checkpoint(mode));
    auto xg = x.clone().requires_grad_(true);
    auto out = model->forward(xg);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{21, 5}));
    torch::nn::functional::cross_entropy(out, y).backward();
    expect_grads_equal(
        gpipe::testing::grads_of(*model), gpipe::testing::grads_of(*plain));
    EXPECT_TRUE(torch::allclose(xg.grad(), xp.grad(), 1e-10, 1e-12));

    // The same through train_step (the target is cut by input rows there,
    // so it must have the input's batch size: per-sample targets [B, T]).
    model->zero_grad();
    auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
      return torch::nn::functional::cross_entropy(out, target.reshape({-1}));
    };
    model->train_step(x, y.reshape({7, 3}), loss_fn);
    // train_step weights each micro-batch by its share of input rows, and
    // every sample has T rows, so the mean is the plain model's.
    expect_grads_equal(
        gpipe::testing::grads_of(*model), gpipe::testing::grads_of(*plain));
  }
}

TEST_F(AutogradTest, BackwardWithCreateGraphIsRefusedAndTheModelStaysUsable) {
  torch::nn::Sequential net(
      torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  gpipe::GPipe model(net, gpipe::GPipeOptions({2, 1}).chunks(2));
  auto x = torch::randn({4, 3}, torch::requires_grad());
  auto loss = model->forward(x).pow(2).sum();
  try {
    loss.backward({}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "backward(create_graph=true) was not refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("create_graph"), std::string::npos)
        << e.what();
  }
  // Still usable: a plain backward of a new forward works.
  model->zero_grad();
  model->forward(x).sum().backward();
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE(p.grad().defined());
  }
}

// Counts a partition's runs by kind.
struct Runs {
  std::atomic<int> plain{0};
  std::atomic<int> checkpointing{0};
  std::atomic<int> recomputing{0};
};

auto counter(Runs& runs) {
  return gpipe::testing::lambda([&runs](torch::Tensor x) {
    (gpipe::is_recomputing()     ? runs.recomputing
     : gpipe::is_checkpointing() ? runs.checkpointing
                                 : runs.plain)++;
    return x;
  });
}

TEST_F(AutogradTest, FrozenBackboneIsNeitherRecomputedNorBackPropagated) {
  Runs backbone_runs;
  std::atomic<int> head_input_requires_grad{0};
  // The same frozen backbone and head each time.
  auto make = [&] {
    torch::manual_seed(9);
    torch::nn::Sequential net(
        torch::nn::Linear(5, 6),
        torch::nn::ReLU(),
        counter(backbone_runs),
        gpipe::testing::lambda([&](torch::Tensor x) {
          head_input_requires_grad += x.requires_grad() ? 1 : 0;
          return x;
        }),
        torch::nn::Linear(6, 3));
    net->to(torch::kFloat64);
    for (auto& p : net[0]->parameters()) {
      p.requires_grad_(false);
    }
    return net;
  };
  auto plain = make();
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto y = torch::randn({8, 3}, torch::kFloat64);
  torch::mse_loss(plain->forward(x), y).backward();
  ASSERT_EQ(head_input_requires_grad.load(), 0);

  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    for (bool train_step : {false, true}) {
      gpipe::GPipe model(
          make(), gpipe::GPipeOptions({3, 2}).chunks(4).checkpoint(mode));
      backbone_runs.recomputing = 0;
      head_input_requires_grad = 0;
      if (train_step) {
        model->train_step(x, y, [](torch::Tensor o, torch::Tensor t) {
          return torch::mse_loss(o, t);
        });
      } else {
        torch::mse_loss(model->forward(x), y).backward();
      }
      EXPECT_EQ(backbone_runs.recomputing.load(), 0)
          << gpipe::to_string(mode) << ", train_step " << train_step;
      // The head's input requires grad nowhere, as in the plain model.
      EXPECT_EQ(head_input_requires_grad.load(), 0) << gpipe::to_string(mode);
      for (const auto& p : model->named_parameters()) {
        if (p.key().rfind("partitions.0.", 0) == 0) {
          EXPECT_FALSE(p.value().grad().defined()) << p.key();
        }
      }
      expect_grads_equal(
          gpipe::testing::grads_of(*model), gpipe::testing::grads_of(*plain));
    }
  }
}

TEST_F(AutogradTest, FrozenMiddlePartitionStillPassesGradientsBack) {
  torch::nn::Sequential net(
      torch::nn::Linear(4, 5),
      torch::nn::Tanh(),
      torch::nn::Linear(5, 5),
      torch::nn::Tanh(),
      torch::nn::Linear(5, 2));
  net->to(torch::kFloat64);
  // Clones get parameters that require grad: freeze after copying.
  auto frozen = [](torch::nn::Sequential seq) {
    for (auto& p : seq[2]->parameters()) {
      p.requires_grad_(false);
    }
    return seq;
  };
  auto plain = frozen(gpipe::testing::copy_of(net));
  auto x = torch::randn({6, 4}, torch::kFloat64);
  plain->forward(x).pow(2).sum().backward();
  for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
    gpipe::GPipe model(
        frozen(gpipe::testing::copy_of(net)),
        gpipe::GPipeOptions({2, 2, 1}).chunks(3).checkpoint(mode));
    model->forward(x).pow(2).sum().backward();
    expect_grads_equal(
        gpipe::testing::grads_of(*model), gpipe::testing::grads_of(*plain));
  }
}

TEST_F(AutogradTest, EveryLayerFrozenGivesAnOutputWithoutGraph) {
  torch::nn::Sequential net(torch::nn::Linear(3, 3), torch::nn::Linear(3, 2));
  for (auto& p : net->parameters()) {
    p.requires_grad_(false);
  }
  gpipe::GPipe model(
      net,
      gpipe::GPipeOptions({1, 1}).chunks(2).checkpoint(Checkpoint::Always));
  auto out = model->forward(torch::randn({4, 3}));
  EXPECT_FALSE(out.requires_grad());
}

}  // namespace
