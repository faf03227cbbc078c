#pragma once

// DeferredBatchNorm: BatchNorm whose running statistics cover the whole
// mini-batch rather than each micro-batch.
//
// Under GPipe a BatchNorm layer sees one micro-batch at a time. Normalising
// each micro-batch with its own statistics is what GPipe does (making it see
// the whole mini-batch would serialise the micro-batches), but updating the
// running mean and variance once per micro-batch would make them drift from
// what the plain model computes. DeferredBatchNorm accumulates the statistics
// of every micro-batch and updates the running statistics once per
// mini-batch, so that they equal those of BatchNorm run on the whole
// mini-batch. It does not accumulate during recomputation.
//
// `GPipeOptions::deferred_batch_norm(true)` puts one in place of every
// BatchNorm{1,2,3}d that tracks running statistics.
//
// Unlike torchgpipe, the running variance is updated with the unbiased
// variance of the mini-batch, as LibTorch's (and PyTorch's) BatchNorm does;
// torchgpipe uses the biased one.

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe {

/// Options for `gpipe::DeferredBatchNorm`; the same as BatchNorm's, plus
/// `chunks`.
struct DeferredBatchNormOptions {
  /* implicit */ DeferredBatchNormOptions(int64_t num_features)
      : num_features_(num_features) {}

  /// Channels (dimension 1 of the input).
  TORCH_ARG(int64_t, num_features);
  /// Added to the variance for numerical stability.
  TORCH_ARG(double, eps) = 1e-5;
  /// Weight of the new statistics in the running ones; `c10::nullopt` for a
  /// cumulative average.
  TORCH_ARG(c10::optional<double>, momentum) = 0.1;
  /// Learnable weight and bias.
  TORCH_ARG(bool, affine) = true;
  /// Micro-batches per mini-batch: the running statistics are updated after
  /// this many training forwards (and by GPipe at the end of each mini-batch
  /// when it had fewer micro-batches).
  TORCH_ARG(int64_t, chunks) = 1;
};

class DeferredBatchNormImpl
    : public torch::nn::Cloneable<DeferredBatchNormImpl> {
 public:
  explicit DeferredBatchNormImpl(DeferredBatchNormOptions options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// Training: normalises `input` with its own statistics and accumulates
  /// them (unless recomputing). Evaluation: normalises with the running
  /// statistics. `input` is (N, C, ...) with C = num_features.
  torch::Tensor forward(torch::Tensor input);

  /// Folds the statistics accumulated so far into the running statistics
  /// and starts over. A no-op when nothing was accumulated.
  void commit();
  /// Drops the statistics accumulated so far (after a failed mini-batch).
  void discard();
  /// When true, statistics accumulate until `commit()` (or `discard()`) is
  /// called, however many micro-batches pass; when false (the default) they
  /// are committed after every `chunks` micro-batches. GPipe sets it on the
  /// layers it runs, and commits once per mini-batch, so that a failed
  /// mini-batch can be discarded.
  void set_manual_commit(bool manual) {
    engine_commits_ = manual;
  }
  /// Micro-batches accumulated since the last commit.
  int64_t tracked() const {
    return tracked_;
  }
  /// Sets training or evaluation. A layer made by
  /// `convert_deferred_batch_norm` from a BatchNorm follows that BatchNorm,
  /// which the user's Sequential still holds: `train(on)` sets both, and
  /// `net->eval()` on the user's Sequential reaches this layer as it reaches
  /// every layer the two share. A copy (`clone()`) follows nothing.
  void train(bool on = true) override;
  /// Whether it normalises with its micro-batches' statistics (training)
  /// or the running ones: the replaced BatchNorm's mode, if any.
  bool in_training() const;
  /// The eps and momentum it computes with: the replaced BatchNorm's
  /// options now (a momentum changed between steps applies, as in the plain
  /// model), if it replaced one; else `options`'.
  void eps_and_momentum(double& eps, c10::optional<double>& momentum) const;

  DeferredBatchNormOptions options;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

 private:
  friend torch::nn::Sequential convert_deferred_batch_norm(
      const torch::nn::Sequential&, int64_t);
  bool engine_commits_ = false;  // see set_manual_commit()
  // The BatchNorm a conversion replaced (see train()); empty otherwise.
  std::weak_ptr<torch::nn::Module> replaced_;
  // Shares `adopt` (weight, bias, running_mean, running_var,
  // num_batches_tracked; undefined ones are made new).
  DeferredBatchNormImpl(
      DeferredBatchNormOptions options, std::vector<torch::Tensor> adopt);
  // Parameters and buffers for the next reset() to register instead of new
  // ones (a conversion shares those of the BatchNorm it replaces).
  std::vector<torch::Tensor> adopt_;
  // Per-channel mean and sum of squared deviations of the elements
  // accumulated so far (merged per micro-batch, Chan et al.), and their
  // count per channel.
  torch::Tensor mean_;
  torch::Tensor m2_;
  int64_t count_ = 0;
  int64_t tracked_ = 0;
};

/// A `ModuleHolder` for `DeferredBatchNormImpl`.
TORCH_MODULE(DeferredBatchNorm);

/// A layer that holds BatchNorm layers inside it, rather than being one
/// child of the Sequential, and can give a copy of itself with those
/// replaced: `convert_deferred_batch_norm` (and so
/// `GPipeOptions::deferred_batch_norm`) asks it instead of refusing it. A
/// C++ layer calls its inner layers through its own members, which nothing
/// outside it can swap; this is how it swaps them itself.
///
/// Example (a residual block whose shortcut is a Sequential):
/// ```
/// torch::nn::AnyModule to_deferred_batch_norm(int64_t chunks) const override {
///   auto copy = std::make_shared<BlockImpl>(*this);  // shares parameters
///   copy->shortcut = copy->replace_module(
///       "shortcut", gpipe::convert_deferred_batch_norm(shortcut, chunks));
///   return torch::nn::AnyModule(copy);
/// }
/// ```
class ConvertibleToDeferredBatchNorm {
 public:
  virtual ~ConvertibleToDeferredBatchNorm() = default;
  /// This layer with every BatchNorm inside it replaced by a
  /// DeferredBatchNorm of `chunks` sharing its parameters and buffers,
  /// for example by `convert_deferred_batch_norm` of an inner Sequential.
  /// The layer itself must stay as it is: the user's model keeps using it.
  virtual torch::nn::AnyModule to_deferred_batch_norm(int64_t chunks) const = 0;
};

/// `module` with every BatchNorm{1,2,3}d child that tracks running
/// statistics replaced by a DeferredBatchNorm sharing
/// its parameters and buffers. Children keep their names. A
/// DeferredBatchNorm with the same `chunks` is kept; one with other `chunks`
/// is replaced. A child that is a `ConvertibleToDeferredBatchNorm` is
/// replaced by its `to_deferred_batch_norm(chunks)`. Throws
/// `c10::ValueError` for a BatchNorm inside any other kind of module (or
/// left inside such a replacement), which cannot be replaced from outside.
torch::nn::Sequential convert_deferred_batch_norm(
    const torch::nn::Sequential& module, int64_t chunks = 1);

}  // namespace gpipe
