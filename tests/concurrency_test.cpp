// One GPipe used from several threads, and pipelines inside pipelines: passes
// are serialised, nothing hangs, and nesting is refused with a clear error.

#include <chrono>
#include <future>
#include <thread>

#include "common.h"

namespace {

using gpipe::Checkpoint;
using gpipe::testing::SeededTest;

class ConcurrencyTest : public SeededTest {};

// Waits for `f`; a pass that never ends ends the test binary instead of
// hanging CI.
template <typename F>
void finish_or_abort(std::future<F>& f, const char* what) {
  if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr, "%s did not finish: deadlock\n", what);
    std::abort();
  }
  f.get();
}

torch::nn::Sequential small_net() {
  return torch::nn::Sequential(
      torch::nn::Linear(4, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::Dropout(0.2),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 2));
}

TEST_F(ConcurrencyTest, ForwardBackwardAndTrainStepFromTwoThreads) {
  gpipe::GPipe model(
      small_net(),
      gpipe::GPipeOptions({3, 2})
          .chunks(4)
          .checkpoint(Checkpoint::ExceptLast)
          .deferred_batch_norm(true));
  constexpr int kSteps = 60;
  // Inputs are drawn before the threads start: drawing from LibTorch's
  // default generator on another thread while a pipeline runs is the
  // user's race (see docs/guide.md, "Random layers").
  std::vector<torch::Tensor> xs;
  std::vector<torch::Tensor> ys;
  for (int s = 0; s < 4 * kSteps; ++s) {
    xs.push_back(torch::randn({8, 4}));
    ys.push_back(torch::randn({8, 2}));
  }
  auto loss_fn = [](torch::Tensor o, torch::Tensor t) {
    return torch::mse_loss(o, t);
  };
  auto a = std::async(std::launch::async, [&] {
    for (int s = 0; s < kSteps; ++s) {
      model->forward(xs[s]).pow(2).mean().backward();
    }
  });
  auto b = std::async(std::launch::async, [&] {
    for (int s = 0; s < kSteps; ++s) {
      model->train_step(
          xs[kSteps + s],
          ys[s],
          loss_fn,
          s % 2 ? gpipe::Schedule::OneFOneB : gpipe::Schedule::FillDrain);
    }
  });
  // A forward on one thread, its backward on another while the first
  // thread runs the next forward.
  auto c = std::async(std::launch::async, [&] {
    for (int s = 0; s < kSteps; ++s) {
      auto out = model->forward(xs[2 * kSteps + s]);
      auto d = std::async(std::launch::async, [&] { out.sum().backward(); });
      model->forward(xs[3 * kSteps + s]);
      d.get();
    }
  });
  finish_or_abort(a, "forward+backward");
  finish_or_abort(b, "train_step");
  finish_or_abort(c, "backward on another thread");
  // Every training pass committed its statistics exactly once.
  int64_t tracked = -1;
  for (const auto& pair : model->named_buffers()) {
    if (pair.key().find("num_batches_tracked") != std::string::npos) {
      tracked = pair.value().item<int64_t>();
    }
  }
  EXPECT_EQ(tracked, 4 * kSteps);
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>());
  }
}

// A layer that holds a GPipe as a submodule and runs it in its forward.
struct WrapperImpl : torch::nn::Module {
  explicit WrapperImpl(gpipe::GPipe inner)
      : inner(register_module("inner", std::move(inner))) {}
  torch::Tensor forward(torch::Tensor x) {
    return inner->forward(x);
  }
  gpipe::GPipe inner;
};
TORCH_MODULE(Wrapper);

TEST_F(ConcurrencyTest, GPipeInsideALayerOfAGPipeIsRefusedAtConstruction) {
  torch::nn::Sequential inner_net(torch::nn::Linear(3, 3), torch::nn::Tanh());
  gpipe::GPipe inner(inner_net, gpipe::GPipeOptions({1, 1}));
  torch::nn::Sequential outer_net(
      torch::nn::Linear(3, 3), Wrapper(inner), torch::nn::Linear(3, 1));
  try {
    gpipe::GPipe outer(outer_net, gpipe::GPipeOptions({2, 1}));
    FAIL() << "a GPipe inside a GPipe was accepted";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("nested"), std::string::npos) << what;
    EXPECT_NE(what.find("1.inner"), std::string::npos) << what;
    EXPECT_EQ(what.find("refuses to move"), std::string::npos) << what;
  }
  // The inner model is untouched and still works.
  EXPECT_EQ(inner->forward(torch::randn({2, 3})).size(0), 2);
}

TEST_F(ConcurrencyTest, PipelineCalledFromInsideACellIsRefused) {
  // A layer that runs another GPipe in its forward (not a child, so the
  // construction check cannot see it) would start a pipeline from a lane.
  torch::nn::Sequential inner_net(torch::nn::Linear(3, 3), torch::nn::Tanh());
  gpipe::GPipe inner(inner_net, gpipe::GPipeOptions({1, 1}));
  torch::nn::Sequential outer_net(
      torch::nn::Linear(3, 3),
      gpipe::testing::lambda(
          [inner](torch::Tensor x) mutable { return inner->forward(x); }),
      torch::nn::Linear(3, 1));
  gpipe::GPipe outer(outer_net, gpipe::GPipeOptions({2, 1}).chunks(2));
  auto f = std::async(std::launch::async, [&] {
    try {
      outer->forward(torch::randn({4, 3}));
      return std::string("accepted");
    } catch (const c10::ValueError& e) {
      return std::string(e.what());
    } catch (const c10::Error& e) {
      return std::string("not a c10::ValueError: ") + e.what();
    }
  });
  if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr, "nested pipeline hung\n");
    std::abort();
  }
  const auto what = f.get();
  EXPECT_NE(what.find("nested"), std::string::npos) << what;
  EXPECT_EQ(what.find("not a c10::ValueError"), std::string::npos) << what;
  // Both stay usable.
  EXPECT_EQ(inner->forward(torch::randn({2, 3})).size(0), 2);
}

}  // namespace
