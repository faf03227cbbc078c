// gpipe::autotune's checks of its arguments (see autotune_verify.h).

#include "balance/autotune_verify.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "device.h"

namespace gpipe::detail {

void verify_autotune(
    const torch::nn::Sequential& net,
    const torch::Tensor& sample_input,
    const torch::Tensor& sample_target,
    const LossFunction& loss_fn,
    const AutotuneOptions& options) {
  TORCH_CHECK_VALUE(
      !net.is_empty() && net->size() > 0,
      "autotune: expected a Sequential with layers");
  const auto layers = static_cast<int64_t>(net->size());
  const auto lanes = options.lanes();
  TORCH_CHECK_VALUE(
      lanes >= 1 && lanes <= layers,
      "autotune: expected lanes between 1 and the model's ",
      layers,
      " layers, but got ",
      lanes);
  TORCH_CHECK_VALUE(
      options.memory_limit() >= 0,
      "autotune: expected memory_limit >= 0 bytes (0: none), but got ",
      options.memory_limit());
  TORCH_CHECK_VALUE(
      !options.schedules().empty() && !options.chunks().empty() &&
          !options.checkpoints().empty(),
      "autotune: expected at least one schedule, chunks and checkpoint mode "
      "to try");
  TORCH_CHECK_VALUE(
      options.param_scale() >= 0 && std::isfinite(options.param_scale()),
      "autotune: expected a finite param_scale >= 0, but got ",
      options.param_scale());
  TORCH_CHECK_VALUE(
      options.threads_per_lane() >= 0 &&
          options.threads_per_lane() <= kMaxThreadsPerLane,
      "autotune: expected threads_per_lane 0 (automatic) or 1 to ",
      kMaxThreadsPerLane,
      ", but got ",
      options.threads_per_lane());
  for (const auto mode : options.checkpoints()) {
    TORCH_CHECK_VALUE(
        mode == Checkpoint::Always || mode == Checkpoint::ExceptLast ||
            mode == Checkpoint::Never,
        "autotune: expected checkpoint modes Always, ExceptLast or Never to "
        "try, but got ",
        static_cast<int>(mode));
  }
  TORCH_CHECK_TYPE(
      static_cast<bool>(loss_fn),
      "autotune: expected a loss_fn, but got an empty function");
  TORCH_CHECK_VALUE(
      options.batch_size() >= 0,
      "autotune: expected batch_size >= 0 rows (0: the sample's), but got ",
      options.batch_size());
  TORCH_CHECK_VALUE(
      std::isfinite(options.profile_seconds()) &&
          options.profile_seconds() >= 0,
      "autotune: expected a finite profile_seconds >= 0 (0: one timed pass "
      "per "
      "micro-batch size), but got ",
      options.profile_seconds());
  TORCH_CHECK_VALUE(
      std::isfinite(options.cell_overhead_seconds()) &&
          options.cell_overhead_seconds() >= 0,
      "autotune: expected a finite cell_overhead_seconds >= 0, but got ",
      options.cell_overhead_seconds());
  TORCH_CHECK_TYPE(
      sample_input.defined() && sample_target.defined(),
      "autotune: expected a sample input and target, but got an undefined "
      "tensor");
  TORCH_CHECK_VALUE(
      sample_input.dim() >= 1 && sample_input.size(0) > 0,
      "autotune: expected a sample input with at least one row in dimension "
      "0, but got shape ",
      sample_input.sizes());
  TORCH_CHECK_VALUE(
      sample_target.dim() >= 1 && sample_input.size(0) == sample_target.size(0),
      "autotune: expected a sample input and target with the same rows in "
      "dimension 0, but got shapes ",
      sample_input.sizes(),
      " and ",
      sample_target.sizes());
  // autotune times the model's backward, which a frozen model never runs
  // (train_step trains only what its loss reads).
  bool trainable = sample_input.requires_grad();
  bool any_parameter = false;
  for (const auto& p : net->parameters()) {
    any_parameter = true;
    trainable = trainable || p.requires_grad();
  }
  TORCH_CHECK_VALUE(
      trainable,
      "autotune: expected a model with a parameter that requires grad (or a "
      "sample input that does), but ",
      any_parameter ? "every parameter is frozen" : "it has no parameters",
      ": autotune times the backward of the layers, which such a model "
      "never runs");
  const auto batch =
      options.batch_size() > 0 ? options.batch_size() : sample_input.size(0);
  const auto sample_rows = sample_input.size(0);
  int64_t most_chunks = 0;  // of those at most the batch
  for (const auto m : options.chunks()) {
    TORCH_CHECK_VALUE(
        m >= 1, "autotune: expected chunks >= 1 to try, but got ", m);
    if (m <= batch) {
      most_chunks = std::max(most_chunks, m);
    }
  }
  // Micro-batches larger than the sample are rejected one by one below;
  // when even the smallest is, nothing can be profiled.
  const auto smallest_rows =
      most_chunks > 0 ? (batch + most_chunks - 1) / most_chunks : batch;
  TORCH_CHECK_VALUE(
      most_chunks == 0 || sample_rows >= smallest_rows,
      "autotune: the smallest micro-batch tried is a micro-batch of ",
      smallest_rows,
      " rows (batch_size ",
      batch,
      " in ",
      most_chunks,
      "), but the sample has ",
      sample_rows,
      " rows; give a sample of at least that many");
}

}  // namespace gpipe::detail
