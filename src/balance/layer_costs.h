#pragma once

// What each layer costs, as the planner (autotune.cpp) models a stage: the
// times of its forward, of the gradients of its inputs and of its weights,
// the bytes its forward keeps for backward, the bytes of its input and of
// its parameters, for one micro-batch of a given number of rows.

#include <gpipe/options.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace gpipe::detail {

struct LayerCosts {
  int64_t rows = 0;
  std::vector<double> forward;       // seconds per layer
  std::vector<double> input;         // input-gradient seconds
  std::vector<double> weight;        // weight-gradient seconds
  std::vector<double> kept_bytes;    // what the forward keeps alive
  std::vector<double> input_bytes;   // the layer's input
  std::vector<double> param_bytes;   // its trainable parameters (once each)
  std::vector<double> frozen_bytes;  // its frozen ones: their values alone
  double loss = 0;                   // loss_fn and its gradient, seconds
  /// Whether the layer's forward draws random numbers. On CPU lanes such a
  /// cell draws from a generator of its own (cell_generator.h), and is
  /// profiled so.
  std::vector<bool> draws;
  /// Whether it draws from the default CPU generator itself (by name, or
  /// where cells cannot have their own): its cells then hold the lease on
  /// the default generators alone and run one at a time (Note [Random
  /// streams of concurrent cells] in src/random.h).
  std::vector<bool> draws_alone;

  size_t size() const {
    return forward.size();
  }
};

/// Each layer of `module` in turn on a copy (see Note [Profiling without
/// touching the module] in sandbox.h), on the first `rows` rows of
/// `input`, then `loss_fn` on the last output and the first `rows` rows of
/// `target`: once counting what each forward keeps, then timed for at least
/// one pass and until `seconds` have gone (the mean of the timed passes).
/// Runs with `threads` intra-op threads and puts the count back. The timed
/// passes run with `busy_lanes` other threads at work beside them
/// (BusyLanes), started after the counting pass: the counting allocator
/// replaces LibTorch's for the whole process while it is installed.
LayerCosts profile_layer_costs(
    const torch::nn::Sequential& module,
    const torch::Tensor& input,
    const torch::Tensor& target,
    const LossFunction& loss_fn,
    int64_t rows,
    double seconds,
    int64_t threads,
    int64_t busy_lanes = 0);

/// Keeps `count` other threads busy training copies of `module` on
/// `input` (`threads` intra-op threads each) while it lives, so that the
/// layers are profiled under the load of the pipeline's other lanes, which
/// run at the same time (on a CPU they share its caches, memory bandwidth
/// and, with hyper-threads, its cores). A module that does not clone gets
/// no companions. Each thread draws from a stream of its own
/// (CpuGeneratorAside), not the program's.
class BusyLanes {
 public:
  BusyLanes(
      const torch::nn::Sequential& module,
      const torch::Tensor& input,
      int64_t count,
      int64_t threads);
  ~BusyLanes();
  BusyLanes(const BusyLanes&) = delete;
  BusyLanes& operator=(const BusyLanes&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace gpipe::detail
