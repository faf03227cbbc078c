#pragma once

// torchgpipe's simplified U-Net as one flat `torch::nn::Sequential`.
//
// Every "cell" is B units of (3x3 convolution without bias, Dropout2d,
// InstanceNorm2d, LeakyReLU(0.01)), 4 layers each. Encoder level i (i = 0 ..
// depth-1) is a cell of C x 2^i channels, a `Stash` of its output under
// "skip" and a 2x2 max-pool; the bottleneck is a cell of C x 2^depth hidden
// and C x 2^(depth-1) output channels; decoder level i (from depth-1 down to
// 0) is a nearest 2x upsampling, a `PopCat` that pops level i's "skip"
// (padding its input on the right and bottom if the sizes differ) and
// concatenates it on the channels, and a cell down to C x 2^(i-1) channels;
// a 1x1 convolution without bias makes the output channels. Level i's skip
// lives in a `gpipe::Namespace` of its own, so the long skips cross any
// partition boundary between their encoder and decoder levels.
//
// With depth 5 the network has 44 B + 21 layers and inputs should be a
// multiple of 32 pixels on each side.

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>

namespace gpipe::models {

/// Settings of `unet` besides (B, C) and the channels.
///
/// Example:
/// ```
/// auto net = gpipe::models::unet(
///     /*B=*/2, /*C=*/8, /*in_channels=*/1, /*out_channels=*/16,
///     gpipe::models::UNetOptions().dropout(0.0));
/// ```
struct UNetOptions {
  /// Encoder (and decoder) levels. Default: 5
  TORCH_ARG(int64_t, depth) = 5;
  /// Probability of Dropout2d after every convolution. Default: 0.1
  TORCH_ARG(double, dropout) = 0.1;
};

/// torchgpipe's simplified U-Net with `B` convolutions per cell and `C` base
/// channels (torchgpipe's `num_convs` and `base_channels`): U-Net(6, 72) has
/// 362,157,516 parameters and U-Net(11, 128) 2,213,834,176. Convolutions
/// keep LibTorch's default initialisation. Throws `c10::ValueError` if `B`,
/// `in_channels`, `out_channels` or `depth` is below 1, `C` below 2, or
/// `dropout` outside [0, 1].
torch::nn::Sequential unet(
    int64_t B,
    int64_t C,
    int64_t in_channels = 3,
    int64_t out_channels = 1,
    const UNetOptions& options = {});

/// The number of parameters `unet(B, C, in_channels, out_channels, options)`
/// has, computed without building it (U-Net(11, 128) would take 8.9 GB).
int64_t unet_parameter_count(
    int64_t B,
    int64_t C,
    int64_t in_channels = 3,
    int64_t out_channels = 1,
    const UNetOptions& options = {});

}  // namespace gpipe::models
