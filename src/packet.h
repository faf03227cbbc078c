#pragma once

// What flows between layers and partitions: one tensor, or a tuple of them.

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <gpipe/microbatch.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <utility>
#include <vector>

namespace gpipe::detail {

/// A micro-batch's tensors, and whether they came as one tensor (`atomic`)
/// or as a std::vector<torch::Tensor>.
struct Packet {
  Batch tensors;
  bool atomic = true;
};

/// The output of a layer or partition as a Packet. Throws c10::TypeError
/// naming the producer (e.g. "layer", 3) when it is neither a tensor nor a
/// std::vector<torch::Tensor>.
inline Packet packet_of(
    torch::nn::AnyValue value, const char* producer, int64_t index) {
  if (auto* t = value.try_get<torch::Tensor>()) {
    return Packet{{std::move(*t)}, true};
  }
  if (auto* ts = value.try_get<std::vector<torch::Tensor>>()) {
    return Packet{std::move(*ts), false};
  }
  TORCH_CHECK_TYPE(
      false,
      "expected ",
      producer,
      " ",
      index,
      " to return torch::Tensor or std::vector<torch::Tensor>, but it "
      "returned ",
      c10::demangle(value.type_info().name()));
}

}  // namespace gpipe::detail
