#pragma once

// Cutting a Sequential into its partitions: GPipe and each rank's
// PipelineStage split the same way, so that layer names and parameter
// names agree across them.

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace gpipe::detail {

/// `module`'s layers in consecutive Sequentials of `balance[j]` layers
/// each; every layer keeps its name and is shared, not copied. `balance`
/// must be verified (verify_balance) first.
std::vector<torch::nn::Sequential> split_partitions(
    const torch::nn::Sequential& module, const std::vector<int64_t>& balance);

}  // namespace gpipe::detail
