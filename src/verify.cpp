#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/verify.h>
#include <torch/cuda.h>

#include <limits>
#include <string>
#include <unordered_map>

#include "text.h"

namespace gpipe {

namespace {

constexpr const char* kRecommendBalance =
    "; compute a balance with gpipe::balance_by_time or gpipe::balance_by_size";

}  // namespace

void verify_balance(const std::vector<int64_t>& balance, int64_t num_layers) {
  int64_t sum = 0;
  bool too_large = false;  // a sum beyond int64's range
  for (auto b : balance) {
    TORCH_CHECK_VALUE(
        b >= 1,
        "every balance entry must be a positive integer, but got balance=",
        c10::IntArrayRef(balance),
        kRecommendBalance);
    too_large = too_large || b > std::numeric_limits<int64_t>::max() - sum;
    sum = too_large ? sum : sum + b;
  }
  TORCH_CHECK_VALUE(
      !too_large && sum == num_layers,
      "balance must sum to the number of layers (",
      num_layers,
      "), but got ",
      too_large ? std::string("a sum beyond int64's range")
                : std::to_string(sum),
      " (balance=",
      c10::IntArrayRef(balance),
      ")",
      kRecommendBalance);
}

void verify_chunks(int64_t chunks) {
  TORCH_CHECK_VALUE(
      chunks >= 1,
      "chunks (the number of micro-batches) must be a positive integer, but "
      "got ",
      chunks);
}

void verify_devices(const std::vector<torch::Device>& devices, int64_t lanes) {
  TORCH_CHECK_VALUE(
      lanes >= 0,
      "verify_devices expects a number of lanes >= 0, but got ",
      lanes);
  TORCH_CHECK_INDEX(
      static_cast<int64_t>(devices.size()) >= lanes,
      "too few devices to hold the partitions: expected at least ",
      detail::count_of(lanes, "device", "devices"),
      " (one per lane; a lane holds one partition, or more with "
      "stages_per_lane or a placement), but got ",
      devices.size(),
      "; a device may be repeated, e.g. {torch::kCPU, torch::kCPU}");
  // Before anything is placed: LibTorch's own error for a CUDA device it
  // cannot reach is a dispatcher dump that names neither the option nor the
  // way out. Devices past the partitions' are dropped unused.
  for (const auto k : c10::irange(lanes)) {
    const auto& device = devices[k];
    // As balance_by_time: a meta device (or another backend) failed only
    // when the first parameter moved, with autograd's set_data message.
    TORCH_CHECK_VALUE(
        device.is_cpu() || device.is_cuda(),
        "devices[",
        k,
        "] must be the CPU or a CUDA device, but got ",
        device);
    if (!device.is_cuda()) {
      continue;
    }
    TORCH_CHECK_VALUE(
        at::hasCUDA(),
        "this LibTorch has no CUDA: devices[",
        k,
        "] is ",
        device,
        ", but LibTorch was built for the CPU only; use torch::kCPU, or "
        "build against a CUDA LibTorch");
    const auto count = static_cast<int64_t>(torch::cuda::device_count());
    TORCH_CHECK_INDEX(
        !device.has_index() || device.index() < count,
        "devices[",
        k,
        "] is ",
        device,
        ", but this machine has ",
        detail::count_of(count, "CUDA device", "CUDA devices"));
  }
}

void verify_module(const torch::nn::Sequential& module) {
  TORCH_CHECK_TYPE(
      !module.is_empty(), "module must be a non-null torch::nn::Sequential");
  std::unordered_map<const torch::nn::Module*, std::string> seen_modules;
  std::unordered_map<const c10::TensorImpl*, std::string> seen_parameters;
  for (const auto& item : module->named_children()) {
    const auto& name = item.key();
    const auto* child = item.value().get();
    auto inserted = seen_modules.emplace(child, name);
    TORCH_CHECK_VALUE(
        inserted.second,
        "a Sequential with the same module twice is not supported: layer '",
        name,
        "' is layer '",
        inserted.first->second,
        "' again; give each position its own module");
    // A module shared deeper down (inside two children) shows up as shared
    // parameters; GPipe places each child on one device, so it cannot work.
    for (const auto& p : item.value()->parameters()) {
      auto p_inserted = seen_parameters.emplace(p.unsafeGetTensorImpl(), name);
      TORCH_CHECK_VALUE(
          p_inserted.second || p_inserted.first->second == name,
          "a Sequential whose children share parameters is not supported: "
          "layers '",
          p_inserted.first->second,
          "' and '",
          name,
          "' hold the same parameter");
    }
  }
}

void verify_batch(const std::vector<torch::Tensor>& inputs) {
  TORCH_CHECK_VALUE(
      !inputs.empty(), "expected at least one input tensor, but got none");
  for (const auto k : c10::irange(inputs.size())) {
    TORCH_CHECK_TYPE(
        inputs[k].defined(),
        "expected a defined tensor, but input ",
        k,
        " is undefined");
    TORCH_CHECK_VALUE(
        inputs[k].dim() >= 1,
        "expected tensors with a batch dimension, but input ",
        k,
        " is a scalar");
  }
  const auto batch = inputs[0].size(0);
  TORCH_CHECK_VALUE(
      batch > 0, "expected a non-empty batch, but input 0 has batch size 0");
  for (const auto k : c10::irange(inputs.size())) {
    TORCH_CHECK_VALUE(
        inputs[k].size(0) == batch,
        "every input tensor must have the same batch size (dim 0): input 0 "
        "has ",
        batch,
        " but input ",
        k,
        " has ",
        inputs[k].size(0));
  }
}

}  // namespace gpipe
