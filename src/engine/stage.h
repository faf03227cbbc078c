#pragma once

// Stage: one partition's compute for one cell (micro-batch): forward,
// recomputation, loss and backward, with its seeds and skips. A stage knows
// nothing of threads, lanes or where its inputs come from: the plan runner
// receives a cell's inputs from the transport, calls the stage, and sends
// what the stage returns.

#include <gpipe/options.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/autocast.h"
#include "packet.h"
#include "random.h"
#include "skip.h"

namespace gpipe {
class DeferredBatchNormImpl;
class Trace;
}  // namespace gpipe

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace gpipe::detail {

struct WeightWork;

/// What flows into or out of a cell: the boundary packet and the skips that
/// cross stages. Forward: activations in, activations out. Backward: the
/// gradients of the outputs in, the gradients of the inputs out.
struct Flow {
  Packet boundary;
  /// By the order of Stage::skips_in() (forward in, backward out) or
  /// Stage::skips_out() (forward out, backward in).
  std::vector<torch::Tensor> skips;
};

/// The train/eval modes of a partition's modules when a pass began, in
/// Module::modules()'s order (each module before its children): what a
/// checkpointed cell's recomputation runs under (Note [The modes of a
/// recomputation] in engine/cell.cpp).
struct ModeSnapshot {
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::vector<DeferredBatchNormImpl*> deferred;  // per module, or nullptr
  std::vector<bool> training;
  /// The parameters that required no grad (frozen), which a recomputation
  /// keeps frozen where they have been unfrozen since.
  std::vector<torch::Tensor> frozen;
};

/// What a cell keeps between its forward and its backward.
struct CellState {
  Packet input;                            // leaves
  std::vector<torch::Tensor> skip_inputs;  // leaves, by skips_in()
  /// With graph, unless checkpointed. On the last stage of a training step
  /// also when checkpointed (without graph), until its loss has run.
  Packet output;
  std::vector<torch::Tensor> skip_outputs;  // with graph, unless checkpointed
  torch::Tensor loss_value;                 // detached
  /// The loss with its graph (last stage of a training step, when a
  /// backward follows): where the cell's backward starts (Note [The loss
  /// and the last stage's backward]).
  torch::Tensor loss_root;
  /// A checkpointed cell's: where the loss's graph ends until the backward
  /// has recomputed the output.
  std::shared_ptr<torch::autograd::Node> loss_junction;
  /// After the input part of a split backward: what its weight part does.
  std::shared_ptr<WeightWork> weight;
  bool has_graph = false;  // backward has something to do
  bool checkpointed = false;
  /// A checkpointed cell's: the version counters of its input and skip
  /// leaves before its forward (Note [In-place changes to a checkpointed
  /// input]).
  std::vector<int64_t> input_versions;
  uint64_t seed = 0;
  RandomOutcome random;
  /// A checkpointed cell's: the modes its forward ran in.
  std::shared_ptr<const ModeSnapshot> modes;
  /// A checkpointed cell's: buffers its recomputation must read as its
  /// forward did, with their values then (Note [Buffers a forward
  /// changes]).
  std::vector<std::pair<torch::Tensor, torch::Tensor>> forward_buffers;
};

/// What one cell runs under; the same for every cell of a pass but the
/// micro-batch's own fields.
struct CellContext {
  int64_t micro_batch = 0;
  bool training = true;
  /// Grad mode was on and something requires grad: build what backward
  /// needs.
  bool grad = false;
  /// Keep only the inputs and recompute in backward.
  bool checkpoint = false;
  /// Some cell of the pass is checkpointed (its forwards note the
  /// parameters' versions as they leave them).
  bool checkpoint_in_pass = false;
  uint64_t seed = 0;
  /// Training step on the last stage: its forward keeps the output for the
  /// loss, which is scaled by the micro-batch's share of the batch. The
  /// loss's own seed is `loss_seed`.
  const LossFunction* loss_fn = nullptr;
  torch::Tensor target;
  double loss_scale = 1.0;
  uint64_t loss_seed = 0;
  /// The pipeline's last stage (its outputs are the pass's).
  bool last_stage = false;
  /// Backward keeps the cell for another backward (retain_graph).
  bool retain = false;
  /// Where to record intervals (null: not tracing), and as which lane.
  Trace* trace = nullptr;
  int64_t lane = 0;
  /// The caller's autocast settings when the pass began: its forwards,
  /// losses and recomputations run under them (Note [Autocast in cells]).
  AutocastState autocast;
};

class Stage {
 public:
  Stage(
      int64_t index,
      torch::nn::Sequential module,
      torch::Device device,
      const SkipLayout& layout);

  int64_t index() const {
    return index_;
  }
  torch::Device device() const {
    return device_;
  }
  const torch::nn::Sequential& module() const {
    return module_;
  }
  /// Skips popped here but stashed in an earlier stage, in the order of
  /// the layout's copy policy.
  const std::vector<SkipKey>& skips_in() const {
    return skips_in_;
  }
  /// Skips stashed here and popped in a later stage.
  const std::vector<SkipKey>& skips_out() const {
    return skips_out_;
  }

  /// Reads which parameters require grad; called by the caller before each
  /// pass (layers may be frozen or unfrozen between passes).
  void refresh();
  bool trainable() const {
    return !trainable_parameters_.empty();
  }
  /// The parameters that required grad at the last refresh().
  const std::vector<torch::Tensor>& trainable_parameters() const {
    return trainable_parameters_;
  }
  /// Per trainable parameter: whether no autograd graph held its gradient
  /// accumulator at the last refresh() (Note [Edges to the parameters]).
  const std::vector<bool>& accumulators_unheld() const {
    return accumulators_unheld_;
  }

  /// The forward of one cell. Returns its outputs, detached, each
  /// requiring grad where the plain model's would. With a loss, the
  /// boundary output is empty: `c` keeps it for `loss`.
  Flow forward(CellState& c, Flow in, const CellContext& ctx);

  /// The loss of a forward kept for it: sets `c.loss_value` and, when a
  /// backward will follow, `c.loss_root`. Runs once per
  /// micro-batch, also when the stage is checkpointed, seeded with
  /// `ctx.loss_seed`.
  void loss(CellState& c, const CellContext& ctx);

  /// The backward of one cell: recomputes if checkpointed, back-propagates
  /// `dy`, and returns the gradients of the cell's inputs
  /// (undefined where none reached them). Does nothing for a cell without
  /// graph or without incoming gradient. Frees `c` unless `ctx.retain`.
  /// With `input_only`, the input part of a split backward: parameter
  /// gradients are left for `backward_weight`, and `c` keeps what that
  /// needs.
  Flow backward(
      CellState& c, Flow dy, const CellContext& ctx, bool input_only = false);

  /// The weight part of a split backward: accumulates the parameters'
  /// gradients and frees `c`.
  void backward_weight(CellState& c, const CellContext& ctx);

  /// DeferredBatchNorm layers: fold the mini-batch's statistics into the
  /// running ones, or drop them after a failure.
  void commit_batch_norms();
  void discard_batch_norms();

  /// Runs the partition's layers on a packet (outside any cell's
  /// bookkeeping: skips go to the current tracker).
  Packet call(const Packet& input);

 private:
  // A parameter's name in the partition, and its shape, for messages.
  std::string name_of_parameter(const torch::Tensor& p) const;
  /// The version counters of `skips` then `inputs` (-1: undefined, or an
  /// inference tensor, which has none).
  static std::vector<int64_t> versions_of(
      const std::vector<torch::Tensor>& skips,
      const std::vector<torch::Tensor>& inputs);
  torch::Tensor loss_of(const torch::Tensor& y, const CellContext& ctx) const;
  // A checkpointed cell's loss, once its backward has recomputed the output
  // `y`: joins the loss's graph to y's (stage_loss.cpp).
  static void connect_loss(CellState& c, const Packet& y);
  // Runs the partition on `x` with skips from `incoming`; fills `y` and
  // `outgoing` (by skips_out).
  void run(
      const Packet& x,
      const std::map<SkipKey, torch::Tensor>& incoming,
      Packet& y,
      std::vector<torch::Tensor>& outgoing);

  int64_t index_;
  torch::nn::Sequential module_;
  torch::Device device_;
  RandomUse random_;       // see Note [Random streams of concurrent cells]
  RandomUse loss_random_;  // the loss's, on the last stage
  std::vector<const Skippable*> skippables_;  // per layer, or nullptr
  std::vector<SkipKey> skips_in_;
  std::vector<SkipKey> skips_out_;
  std::set<SkipKey> skips_out_set_;
  std::vector<DeferredBatchNormImpl*> deferred_batch_norms_;
  std::vector<torch::Tensor> trainable_parameters_;  // by refresh()
  // Every parameter, by refresh().
  std::shared_ptr<const std::vector<torch::Tensor>> parameters_;
  // The version counters of the parameters as this stage's layers last left
  // them (after a forward or a recomputation), and the list they are of
  // (Note [In-place changes to a checkpointed input]). Cells of two passes
  // may run at once on callers' threads: guarded.
  std::mutex left_mutex_;
  std::shared_ptr<const std::vector<torch::Tensor>> left_parameters_;
  std::vector<int64_t> left_versions_;
  // A few values of each CPU parameter, as bytes, and where each one's end
  // (Note [Parameters written through .data()]).
  std::vector<uint8_t> left_samples_;
  std::vector<size_t> left_sample_ends_;
  std::atomic<bool> noted_{false};  // a note was taken
  // Records the versions of `parameters` now, as the layers leave them.
  void note_parameters_left(
      const std::shared_ptr<const std::vector<torch::Tensor>>& parameters);
  // Refuses a parameter changed in place since the layers last ran; returns
  // the list it checked (nullptr when none was noted).
  std::shared_ptr<const std::vector<torch::Tensor>>
  check_parameters_unchanged();
  std::vector<bool> accumulators_unheld_;      // by refresh()
  std::shared_ptr<const ModeSnapshot> modes_;  // by refresh()

  // Note [Buffers a forward changes] (stage_buffers.cpp). The partition's
  // buffers (by refresh()), and what checkpointed forwards showed of each:
  // changed by some forward, or left as found; a buffer not in the map
  // was not seen yet. Cells of two passes may run at once: guarded.
  enum class BufferSeen : uint8_t { Unchanged, Changed };
  std::mutex buffers_mutex_;
  std::shared_ptr<const std::vector<torch::Tensor>> buffers_;
  std::unordered_map<const c10::TensorImpl*, BufferSeen> buffers_seen_;
  // Takes `buffers` as the partition's, keeping what was seen of those
  // that were already.
  void refresh_buffers(
      std::shared_ptr<const std::vector<torch::Tensor>> buffers);
  // Before a checkpointed forward: keeps in `c` the values of the buffers
  // that a forward changed or that were not seen yet; returns the
  // buffers' list and their versions now, for buffers_after_forward.
  std::pair<
      std::shared_ptr<const std::vector<torch::Tensor>>,
      std::vector<int64_t>>
  buffers_before_forward(CellState& c);
  // After it: notes which buffers it changed, and lets go of the values
  // of buffers that no forward changed.
  void buffers_after_forward(
      CellState& c,
      const std::shared_ptr<const std::vector<torch::Tensor>>& buffers,
      const std::vector<int64_t>& versions);
  // Before a recomputation: the buffers `c` kept, as they were (without a
  // version bump).
  static void put_forward_buffers(const CellState& c);
};

/// True on a thread inside a cell (a layer's forward or backward, or the
/// loss). Starting a pipeline there is refused: see Note [Random streams of
/// concurrent cells].
bool inside_cell();

}  // namespace gpipe::detail
