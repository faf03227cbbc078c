#pragma once

// AmoebaNet-D (L, D) as torchgpipe's benchmark builds it, one layer per cell.
//
// Layers: a stem (ReLU, 3x3 stride-2 convolution of D/4 channels, BatchNorm),
// two reduction cells, L/3 normal cells, a reduction cell, L/3 normal cells,
// a reduction cell, L/3 normal cells and a classifier (7x7 average pooling,
// Flatten, Linear): L + 6 layers. A cell reads the outputs of the two cells
// before it, so layers pass `std::vector<torch::Tensor>` between them: the
// stem returns {x}, every cell {its output, its first input} and the
// classifier takes that pair and returns the logits. Inside GPipe both
// tensors of the pair travel to the next partition.
//
// Genotype and channel arithmetic follow torchgpipe (normal cells concatenate
// states {0, 3, 4, 6} as TensorFlow's reference does, which reproduces the
// GPipe paper's model sizes), including its `max_pool_3x3` operation, which
// is an average pooling there and here. The classifier's 7x7 pooling expects
// 224x224 inputs (the cells reduce by 32).

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>

namespace gpipe::models {

/// AmoebaNet-D with `L` normal cells (a multiple of 3) and `D` filters (the
/// stem has D/4 channels, the first normal cells D): AmoebaNet-D(18, 208)
/// has 81,505,540 parameters for 1000 classes (the GPipe paper's 82M).
/// Throws `c10::ValueError` if `L` is negative or not a multiple of 3, `D`
/// is below 8, or `num_classes` below 1.
torch::nn::Sequential amoebanetd(
    int64_t L, int64_t D, int64_t num_classes = 1000);

}  // namespace gpipe::models
