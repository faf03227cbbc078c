#include "engine/partitions.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/module.h>
#include <gpipe/options.h>
#include <gpipe/placement.h>
#include <gpipe/skip.h>
#include <gpipe/verify.h>

#include <string>

#include "device.h"
#include "text.h"

namespace gpipe::detail {

void verify_checkpoint_mode(Checkpoint mode) {
  TORCH_CHECK_VALUE(
      mode == Checkpoint::Always || mode == Checkpoint::ExceptLast ||
          mode == Checkpoint::Never,
      "checkpoint must be Checkpoint::Always, Checkpoint::ExceptLast or "
      "Checkpoint::Never, but got Checkpoint(",
      static_cast<int>(mode),
      ")");
}

void verify_options(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    const char* who) {
  verify_module(module);
  // A GPipe among the layers would run its own pipeline from inside a cell
  // of this one; see Note [Random streams of concurrent cells].
  for (const auto& named : module->named_modules("", /*include_self=*/false)) {
    TORCH_CHECK_VALUE(
        named.value()->as<GPipeImpl>() == nullptr,
        who,
        " cannot hold a gpipe::GPipe (layer '",
        named.key(),
        "' is one): nested pipelines are not supported; pass the inner "
        "model's Sequential instead, its layers become partitions of this "
        "pipeline");
  }
  verify_skippables(module);
  verify_chunks(options.chunks());
  verify_checkpoint_mode(options.checkpoint());
  verify_balance(options.balance(), static_cast<int64_t>(module->size()));
  const auto n = static_cast<int64_t>(options.balance().size());
  const auto v = options.stages_per_lane();
  TORCH_CHECK_VALUE(
      v >= 1 && n % v == 0,
      "stages_per_lane must be positive and divide the number of partitions "
      "(balance has ",
      n,
      "), but got ",
      v);
  const auto& placement = options.placement();
  if (!placement.empty()) {
    verify_placement(placement, n, -1, std::string(who) + "'s options");
    TORCH_CHECK_VALUE(
        v == 1 || placement.lanes() * v == n,
        who,
        ": the placement ",
        to_string(placement),
        " puts ",
        n,
        " partitions on ",
        count_of(placement.lanes(), "lane", "lanes"),
        ", but stages_per_lane is ",
        v,
        "; leave stages_per_lane at 1 when giving a placement");
  }
  TORCH_CHECK_VALUE(
      options.threads_per_lane() >= 0 &&
          options.threads_per_lane() <= kMaxThreadsPerLane,
      "threads_per_lane must be 0 (automatic) or 1 to ",
      kMaxThreadsPerLane,
      ", but got ",
      options.threads_per_lane());
}

void verify_layout_unchanged(
    const GPipeOptions& now, const GPipeOptions& built, const char* who) {
  std::string field;
  std::string was;
  std::string is;
  if (now.balance() != built.balance()) {
    field = "balance";
    was = c10::str(c10::IntArrayRef(built.balance()));
    is = c10::str(c10::IntArrayRef(now.balance()));
  } else if (now.devices() != built.devices()) {
    field = "devices";
    was = c10::str(c10::ArrayRef<torch::Device>(built.devices()));
    is = c10::str(c10::ArrayRef<torch::Device>(now.devices()));
  } else if (now.stages_per_lane() != built.stages_per_lane()) {
    field = "stages_per_lane";
    was = std::to_string(built.stages_per_lane());
    is = std::to_string(now.stages_per_lane());
  } else if (!(now.placement() == built.placement())) {
    field = "placement";
    was = built.placement().empty() ? "none" : to_string(built.placement());
    is = now.placement().empty() ? "none" : to_string(now.placement());
  } else if (now.threads_per_lane() != built.threads_per_lane()) {
    field = "threads_per_lane";
    was = std::to_string(built.threads_per_lane());
    is = std::to_string(now.threads_per_lane());
  } else if (now.deferred_batch_norm() != built.deferred_batch_norm()) {
    field = "deferred_batch_norm";
    was = built.deferred_batch_norm() ? "true" : "false";
    is = now.deferred_batch_norm() ? "true" : "false";
  } else {
    return;
  }
  TORCH_CHECK_VALUE(
      false,
      who,
      " was built with options.",
      field,
      "() ",
      was,
      ", but it is now ",
      is,
      ": the layout (balance, devices, stages_per_lane, placement, "
      "threads_per_lane, deferred_batch_norm) is fixed when the model is "
      "built, and only chunks and checkpoint may change between passes; set "
      "it back, or build a new model for another layout");
}

Placement placement_of(const GPipeOptions& options) {
  if (!options.placement().empty()) {
    return options.placement();
  }
  const auto n = static_cast<int64_t>(options.balance().size());
  const auto v = options.stages_per_lane();
  return n == 0 ? Placement() : Placement::modulo(n / v, v);
}

std::vector<torch::nn::Sequential> split_partitions(
    const torch::nn::Sequential& module, const std::vector<int64_t>& balance) {
  const auto named = module->named_children();
  std::vector<torch::nn::Sequential> parts;
  size_t layer = 0;
  for (const auto size : balance) {
    torch::nn::Sequential part;
    for (const auto k : c10::irange(size)) {
      (void)k;
      TORCH_INTERNAL_ASSERT(layer < named.size());
      part->push_back(named[layer].key(), *(module->begin() + layer));
      ++layer;
    }
    parts.push_back(part);
  }
  TORCH_INTERNAL_ASSERT(layer == named.size());
  return parts;
}

bool layers_training(
    const std::vector<std::shared_ptr<torch::nn::Module>>& partitions,
    bool own) {
  bool any = false;
  for (const auto& partition : partitions) {
    for (const auto& layer : partition->children()) {
      // A DeferredBatchNorm computes in the mode of the layer it replaced,
      // which the user's Sequential holds: net->eval() sets that one.
      const auto* deferred =
          dynamic_cast<const DeferredBatchNormImpl*>(layer.get());
      if (deferred != nullptr ? deferred->in_training()
                              : layer->is_training()) {
        return true;
      }
      any = true;
    }
  }
  return any ? false : own;
}

}  // namespace gpipe::detail
