#pragma once

// Shared helpers for the gpipe tests: a seeding fixture and small models.

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace gpipe::testing {

/// Seeds LibTorch's generators before each test, as torchgpipe's conftest.
class SeededTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
  }
};

/// Throws std::runtime_error("boom") from forward when `armed`.
struct RaiseImpl : torch::nn::Module {
  explicit RaiseImpl(bool armed = true) : armed(armed) {}
  torch::Tensor forward(torch::Tensor x) {
    if (armed) {
      throw std::runtime_error("boom");
    }
    return x;
  }
  bool armed;
};
TORCH_MODULE(Raise);

/// Records a value per forward call through `log` (not thread-safe by itself:
/// one partition's layers run on one lane).
template <typename F>
struct LambdaImpl : torch::nn::Module {
  explicit LambdaImpl(F f) : f(std::move(f)) {}
  torch::Tensor forward(torch::Tensor x) {
    return f(x);
  }
  F f;
};

template <typename F>
std::shared_ptr<LambdaImpl<F>> lambda(F f) {
  return std::make_shared<LambdaImpl<F>>(std::move(f));
}

/// Stashes tanh(x) under "skip" and passes x on.
struct TanhStashImpl : torch::nn::Cloneable<TanhStashImpl>, Skippable {
  TanhStashImpl() : Skippable({"skip"}, {}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    stash("skip", x.tanh());
    return x;
  }
};
TORCH_MODULE(TanhStash);

/// Pops "skip" and adds it.
struct PopAddImpl : torch::nn::Cloneable<PopAddImpl>, Skippable {
  PopAddImpl() : Skippable({}, {"skip"}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    return x + pop("skip");
  }
};
TORCH_MODULE(PopAdd);

/// Gradients of every parameter, in order.
inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : m.parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  return grads;
}

/// Expects the parameters of `got` to have the gradients of `expected`'s
/// (relative 1e-10: float64 models), in order.
inline void expect_same_gradients(
    torch::nn::Module& expected, torch::nn::Module& got) {
  auto g1 = grads_of(expected);
  auto g2 = grads_of(got);
  ASSERT_EQ(g1.size(), g2.size());
  for (size_t k = 0; k < g1.size(); ++k) {
    ASSERT_EQ(g1[k].defined(), g2[k].defined()) << "parameter " << k;
    if (g1[k].defined()) {
      EXPECT_TRUE(torch::allclose(g2[k], g1[k], 1e-10, 1e-13))
          << "parameter " << k << ", max difference "
          << (g2[k] - g1[k]).abs().max().item<double>();
    }
  }
}

/// A deep copy of `net` (same values, separate parameters).
inline torch::nn::Sequential copy_of(const torch::nn::Sequential& net) {
  return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
}

}  // namespace gpipe::testing
