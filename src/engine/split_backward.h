#pragma once

// A cell's backward in two parts, for zero-bubble schedules: the input
// part computes only the gradients of the cell's inputs (what the previous
// stage waits for), the weight part later computes the parameters'
// gradients, without redoing the input part's work.
// See Note [Splitting a backward].

#include <torch/types.h>

#include <memory>
#include <vector>

namespace gpipe::detail {

/// What the weight part needs from the input part: the autograd nodes
/// where the gradient paths to the inputs and to the parameters part, with
/// the gradients that reached them.
struct WeightWork;

/// Back-propagates `grads` from `roots` to `leaves` only and returns their
/// gradients (undefined for a leaf that needs none or got none). Sets
/// `weight` to what the weight part must still do (null for nothing). When
/// the graph cannot be split (a parameter reached along two gradient
/// paths that meet only there), this runs the whole backward now, and the
/// weight part has nothing left.
std::vector<torch::Tensor> backward_input(
    const std::vector<torch::Tensor>& roots,
    const std::vector<torch::Tensor>& grads,
    const std::vector<torch::Tensor>& leaves,
    std::shared_ptr<WeightWork>& weight);

/// Accumulates the parameters' gradients into `.grad`; frees `weight`'s
/// graph unless `retain`.
void backward_weight(WeightWork& weight, bool retain);

}  // namespace gpipe::detail
