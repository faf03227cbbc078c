#pragma once

// The engine: runs a schedule of cells over partitions and lanes, forward and
// backward, and ties the pipeline into autograd with one node.

#include <gpipe/microbatch.h>
#include <gpipe/options.h>
#include <gpipe/schedule.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <memory>
#include <mutex>
#include <vector>

#include "packet.h"
#include "random.h"
#include "skip.h"
#include "worker.h"

namespace gpipe {
class DeferredBatchNormImpl;
class Trace;
}  // namespace gpipe

namespace gpipe::detail {

/// One partition as the engine sees it.
struct Stage {
  torch::nn::Sequential module;
  torch::Device device = torch::kCPU;
  RandomUse random;  // see Note [Random streams of concurrent cells]
  /// Per layer: the layer as a Skippable, or nullptr.
  std::vector<const Skippable*> skippables;
  /// Skips popped here but stashed in an earlier partition, in the order
  /// of the layout's copy policy.
  std::vector<SkipKey> skips_in;
  /// Skips stashed here and popped in a later partition.
  std::set<SkipKey> skips_out;
  /// DeferredBatchNorm layers, committed after each training forward.
  std::vector<DeferredBatchNormImpl*> deferred_batch_norms;
};

/// How one forward pass runs.
struct PassOptions {
  bool training = true;
  /// Micro-batches `i < checkpoint_stop` are checkpointed (when a graph is
  /// built at all).
  int64_t checkpoint_stop = 0;
};

class Run;  // one pass's state, in pipeline.cpp

class Pipeline : public std::enable_shared_from_this<Pipeline> {
 public:
  /// One lane per partition; CPU lanes get `threads_per_lane` intra-op threads.
  Pipeline(
      std::vector<torch::nn::Sequential> partitions,
      std::vector<torch::Device> devices,
      int64_t threads_per_lane);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Runs `inputs` (already scattered) through every partition and returns
  /// the last partition's outputs gathered into one packet. When grad mode
  /// is on and anything requires grad, the returned tensors are connected to
  /// autograd: their backward runs the pipelined backward, and gradients
  /// reach `inputs` and the parameters.
  Packet forward(
      std::vector<Packet> inputs,
      const Batch& original_inputs,
      const PassOptions& options);

  /// A training step in one pass: every micro-batch forward, its loss
  /// (`loss_fn(output, target)` times its share of the batch) on the last
  /// partition, and backward, in the order `schedule` gives. Gradients
  /// accumulate into the parameters' `.grad` (and flow into inputs that
  /// require grad). Returns the batch's loss, detached.
  torch::Tensor train(
      std::vector<Packet> inputs,
      std::vector<torch::Tensor> targets,
      const Batch& original_inputs,
      const LossFunction& loss_fn,
      Schedule schedule,
      const PassOptions& options);

  int64_t size() const {
    return static_cast<int64_t>(stages_.size());
  }
  Stage& stage(int64_t j) {
    return *stages_[j];
  }
  Lane& lane(int64_t j) {
    return *lanes_[j];
  }
  /// True when backward runs on the autograd engine's thread rather than on
  /// the lanes. See Note [Backward on CUDA lanes].
  bool backward_inline() const {
    return backward_inline_;
  }
  const SkipLayout& skip_layout() const {
    return skip_layout_;
  }
  /// Where passes record their cells; null for none. Set between passes.
  void set_trace(std::shared_ptr<Trace> trace) {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    trace_ = std::move(trace);
  }
  std::shared_ptr<Trace> trace() const {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    return trace_;
  }

 private:
  // Runs `steps` on `run`, then commits (or, on error, discards)
  // DeferredBatchNorm statistics.
  void run_and_commit(const std::shared_ptr<Run>& run, const Steps& steps);

  std::vector<std::unique_ptr<Stage>> stages_;
  // Declared after stages_ so that lanes are joined before stages go away.
  std::vector<std::unique_ptr<Lane>> lanes_;
  bool backward_inline_ = false;
  SkipLayout skip_layout_;
  mutable std::mutex trace_mutex_;
  std::shared_ptr<Trace> trace_;  // guarded by trace_mutex_
};

/// Runs one partition on a micro-batch: the layers one after the other, a
/// layer's output (torch::Tensor or std::vector<torch::Tensor>) being the
/// next one's input. A Skippable layer must use every name it declared.
Packet call_partition(Stage& stage, const Packet& input, int64_t partition);

}  // namespace gpipe::detail
