#pragma once

#include <gpipe/placement.h>
#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gpipe {

/// Which micro-batches keep only their input and recompute in backward.
enum class Checkpoint {
  /// Every micro-batch is checkpointed: least memory.
  Always,
  /// Every micro-batch but the last: the last one's backward starts at once.
  ExceptLast,
  /// Nothing is recomputed: fastest, most memory.
  Never,
};

/// "always", "except_last" or "never" (torchgpipe's spelling).
std::string to_string(Checkpoint checkpoint);

/// Parses torchgpipe's spelling; throws `c10::ValueError` on anything else.
Checkpoint checkpoint_from_string(const std::string& name);

/// A loss for `GPipe::train_step`: `(output, target) -> scalar`, a mean
/// over the micro-batch it is given (as LibTorch's losses by default).
using LossFunction = std::function<torch::Tensor(torch::Tensor, torch::Tensor)>;

/// Options for `gpipe::GPipe`.
///
/// Example:
/// ```
/// gpipe::GPipe model(net, gpipe::GPipeOptions({4, 4})
///                             .chunks(8)
///                             .checkpoint(gpipe::Checkpoint::ExceptLast));
/// ```
struct GPipeOptions {
  /* implicit */ GPipeOptions(std::vector<int64_t> balance)
      : balance_(std::move(balance)) {}

  /// Number of layers in each partition. Required; must sum to the number of
  /// layers of the Sequential.
  TORCH_ARG(std::vector<int64_t>, balance);

  /// Device of each lane (of each partition when stages_per_lane is 1);
  /// may repeat a device. Extra devices are ignored. Default: every CUDA
  /// device if there is one, else one CPU lane per partition.
  TORCH_ARG(std::vector<torch::Device>, devices) = {};

  /// Partitions per lane: with `balance.size() == n * v`, partition j runs
  /// on lane j % n (and its device), so each lane holds v partitions that
  /// are not adjacent, as `Schedule::Interleaved1F1B` needs. Default: 1.
  TORCH_ARG(int64_t, stages_per_lane) = 1;

  /// Which lane runs each partition, e.g. `Placement::v_shape(2)` for
  /// `Schedule::ZeroBubbleV` on 4 partitions. Default (empty):
  /// `Placement::modulo(n / stages_per_lane, stages_per_lane)`. When given,
  /// it places every partition, and stages_per_lane is left at 1 or
  /// matches it (partitions / its lanes).
  TORCH_ARG(Placement, placement) = {};

  /// Number of micro-batches each mini-batch is cut into. Default: 1.
  TORCH_ARG(int64_t, chunks) = 1;

  /// Which micro-batches are checkpointed in training. Default: ExceptLast.
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::ExceptLast;

  /// Track BatchNorm running statistics over the whole mini-batch rather than
  /// per micro-batch: every BatchNorm{1,2,3}d child that tracks them is
  /// replaced by a `gpipe::DeferredBatchNorm` sharing its parameters and
  /// buffers (see gpipe/batchnorm.h). Default: false.
  TORCH_ARG(bool, deferred_batch_norm) = false;

  /// Intra-op threads of each CPU lane. 0 (the default): max(1, cores /
  /// CPU lanes) (cores: OMP_NUM_THREADS when set, else the hardware's), and
  /// the CPU lanes share the cores by the plan: in a plan that never runs
  /// two CPU lanes at once (every plan at chunks 1), each cell is computed
  /// with every core. A positive count is each lane's throughout.
  TORCH_ARG(int64_t, threads_per_lane) = 0;
};

}  // namespace gpipe
