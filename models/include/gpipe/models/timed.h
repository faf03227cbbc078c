#pragma once

// A layer whose cost is fixed: its forward, the input part of its backward
// and the weight part each wait a set time, whatever the cores are doing.
// Schedules measured with it match their simulations, so the bubbles they
// leave can be told apart from the machine's noise. It also counts how
// often each part ran (a split backward must run each once per cell).
//
// The layer is y = x * w with one weight per feature, so it has an input
// gradient (g * w) and a weight gradient (sum of g * x), computed apart.

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

namespace gpipe::models {

/// How often the parts of the layers sharing it ran.
struct TimedCounts {
  std::atomic<int64_t> forward{0};
  std::atomic<int64_t> backward_input{0};
  std::atomic<int64_t> backward_weight{0};
};

/// What each part of a `TimedLayer` costs.
struct TimedCosts {
  std::chrono::microseconds forward{1000};
  std::chrono::microseconds backward_input{1000};
  std::chrono::microseconds backward_weight{1000};
};

class TimedLayerImpl : public torch::nn::Cloneable<TimedLayerImpl> {
 public:
  explicit TimedLayerImpl(
      int64_t features,
      TimedCosts costs = {},
      std::shared_ptr<TimedCounts> counts = nullptr);
  void reset() override;
  torch::Tensor forward(torch::Tensor x);

  torch::Tensor weight;

 private:
  int64_t features_;
  TimedCosts costs_;
  std::shared_ptr<TimedCounts> counts_;
};
TORCH_MODULE(TimedLayer);

}  // namespace gpipe::models
