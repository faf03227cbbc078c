#pragma once

// Micro-batches: cutting a mini-batch of one or more tensors along dim 0 and
// putting the pieces back together.

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe {

/// One micro-batch: every tensor of a (tuple) batch, in order. A single-tensor
/// batch has size 1.
using Batch = std::vector<torch::Tensor>;

/// Cuts every tensor into `chunks` pieces along dim 0 with `Tensor::chunk`
/// and zips them per micro-batch. Like `chunk`, fewer than `chunks`
/// micro-batches come back when the batch is small (batch 2, chunks 4 gives
/// two micro-batches of 1). All tensors must share the batch size.
std::vector<Batch> scatter(const Batch& inputs, int64_t chunks);

/// Concatenates the micro-batches tensor by tensor along dim 0; a tensor
/// undefined in every micro-batch (an optional output) stays undefined,
/// one undefined in some only is a c10::ValueError.
Batch gather(const std::vector<Batch>& micro_batches);

}  // namespace gpipe
