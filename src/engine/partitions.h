#pragma once

// Cutting a Sequential into its partitions: GPipe and each rank's
// PipelineStage check their model and options alike and split the same
// way, so that layer names and parameter names agree across them.

#include <gpipe/options.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace gpipe {
class Placement;
}  // namespace gpipe

namespace gpipe::detail {

/// What GPipe and PipelineStage (`who` names it in the errors) check of
/// their model and options before anything is built: a module without
/// repeats or a nested GPipe, skips that pair up, chunks, a balance that
/// covers the layers, stages_per_lane dividing the partitions, a placement
/// of every partition that agrees with stages_per_lane, a checkpoint mode,
/// and threads_per_lane. A c10::Error names what is wrong.
void verify_options(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    const char* who);

/// Refuses a Checkpoint that is none of the enum's values (a cast integer).
void verify_checkpoint_mode(Checkpoint mode);

/// Refuses a pass of a model built with `built` whose public `options` now
/// has another layout: balance, devices, stages_per_lane, placement,
/// threads_per_lane or deferred_batch_norm were changed after it was built.
/// Only chunks and checkpoint may change between passes.
void verify_layout_unchanged(
    const GPipeOptions& now, const GPipeOptions& built, const char* who);

/// The placement `options` (verified) asks for: `options.placement()`, or
/// `Placement::modulo(partitions / stages_per_lane, stages_per_lane)`.
Placement placement_of(const GPipeOptions& options);

/// `module`'s layers in consecutive Sequentials of `balance[j]` layers
/// each; every layer keeps its name and is shared, not copied. `balance`
/// must be verified (verify_balance) first.
std::vector<torch::nn::Sequential> split_partitions(
    const torch::nn::Sequential& module, const std::vector<int64_t>& balance);

/// Whether a pass over `partitions` (each a Sequential of layers) trains:
/// while any of their layers is in training mode, whatever the pipeline's
/// own flag says, so that `eval()` on the user's Sequential (whose layers
/// the partitions share) turns checkpointing off as `eval()` on the GPipe
/// does (a DeferredBatchNorm's mode: the one it computes in,
/// in_training()); with no layers, `own`, the pipeline's flag.
bool layers_training(
    const std::vector<std::shared_ptr<torch::nn::Module>>& partitions,
    bool own);

}  // namespace gpipe::detail
