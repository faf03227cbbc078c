#pragma once

// The autograd node that stands for a whole pipeline pass: a GPipe output's
// grad_fn. Its backward runs the pipelined backward of every cell.

#include <gpipe/microbatch.h>

#include <memory>
#include <vector>

#include "packet.h"

namespace gpipe::detail {

class Pipeline;
class Pass;

/// Gathers the last stage's micro-batch outputs into whole tensors and,
/// when `pass` built a graph, makes the ones that require grad outputs of
/// one autograd node whose backward is the pipelined backward of `pass`.
/// `input_rows`: the rows of each input micro-batch.
Packet connect_outputs(
    std::shared_ptr<Pipeline> pipeline,
    std::shared_ptr<Pass> pass,
    std::vector<Packet> outputs,
    const Batch& original_inputs,
    std::vector<int64_t> input_rows);

/// The gradient of input k joined from every micro-batch's input gradients
/// (`rows` each), with `shape` and `options`; a micro-batch whose gradient
/// did not reach the input contributes zeros. Undefined when none did.
torch::Tensor join_input_grad(
    const std::vector<Packet>& dx,
    size_t k,
    const std::vector<int64_t>& rows,
    std::vector<int64_t> shape,
    const torch::TensorOptions& options);

}  // namespace gpipe::detail
