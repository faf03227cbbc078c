#pragma once

// ResNet with bottleneck blocks as one flat `torch::nn::Sequential`, the way
// torchgpipe's benchmarks build it, so that GPipe can cut it anywhere.
//
// Each bottleneck becomes 11 layers: `identity` (stashes its input under the
// skip name "identity"), conv1, bn1, relu1, conv2, bn2, relu2, conv3, bn3,
// `residual` (pops the identity, downsamples it when the shape changes, adds)
// and relu3. Every block puts "identity" in a `gpipe::Namespace` of its own,
// so a cut inside a block carries the identity across partitions as a skip.
// The downsampling BatchNorm lives inside `residual` (as in torchgpipe, so
// that ResNet-101 keeps its 370 layers); `residual` is a
// `gpipe::ConvertibleToDeferredBatchNorm`, so `deferred_batch_norm(true)`
// converts it too.

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace gpipe::models {

/// How `resnet` shapes the network besides its blocks and classes.
///
/// Example:
/// ```
/// auto net = gpipe::models::resnet(
///     {1, 1, 1}, /*num_classes=*/10,
///     gpipe::models::ResNetOptions().in_channels(1).width(16).small_stem(true));
/// ```
struct ResNetOptions {
  /// Channels of the input images. Default: 3
  TORCH_ARG(int64_t, in_channels) = 3;
  /// Planes of the first stage's bottlenecks; every later stage doubles them,
  /// and a bottleneck outputs 4 x its planes. Default: 64
  TORCH_ARG(int64_t, width) = 64;
  /// false: ImageNet stem (7x7 stride-2 convolution, BatchNorm, ReLU, 3x3
  /// stride-2 max-pool, 4 layers). true: a 3x3 stride-1 convolution,
  /// BatchNorm and ReLU (3 layers), for 28x28 or 32x32 images. Default: false
  TORCH_ARG(bool, small_stem) = false;
};

/// A ResNet of bottleneck blocks, `blocks_per_stage[s]` blocks in stage `s`
/// (stages after the first halve the resolution), then adaptive average
/// pooling, Flatten and a Linear classifier, flattened into one Sequential:
/// stem layers, 11 layers per block, then avgpool, flat and fc. Convolutions
/// are initialised as torchvision does (Kaiming normal, fan-out).
/// Throws `c10::ValueError` for an empty `blocks_per_stage`, a stage with no
/// block, or a size below 1.
torch::nn::Sequential resnet(
    std::vector<int64_t> blocks_per_stage,
    int64_t num_classes = 1000,
    const ResNetOptions& options = {});

/// ResNet-101 for 224x224 RGB images: `resnet({3, 4, 23, 3}, num_classes)`,
/// 370 layers, torchvision's 44,549,160 parameters for 1000 classes.
torch::nn::Sequential resnet101(int64_t num_classes = 1000);

/// A small ResNet for 28x28 grayscale images (Fashion-MNIST): the small stem
/// with 8 channels, then stages of one bottleneck each (8, 16 and 32 planes
/// at 28x28, 14x14 and 7x7), 39 layers, 33,090 parameters for 10 classes.
torch::nn::Sequential resnet_small(int64_t num_classes = 10);

}  // namespace gpipe::models
