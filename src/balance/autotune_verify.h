#pragma once

// What gpipe::autotune checks of its arguments before it profiles anything
// (src/balance/autotune.cpp runs the search).

#include <gpipe/autotune.h>
#include <torch/torch.h>

namespace gpipe::detail {

/// Throws a c10::Error (ValueError or TypeError) saying what was expected
/// and what was got when autotune cannot run on these arguments: no
/// layers, lanes out of range, options out of range, no loss_fn, a sample
/// whose rows do not match or are fewer than the smallest micro-batch.
void verify_autotune(
    const torch::nn::Sequential& net,
    const torch::Tensor& sample_input,
    const torch::Tensor& sample_target,
    const LossFunction& loss_fn,
    const AutotuneOptions& options);

}  // namespace gpipe::detail
