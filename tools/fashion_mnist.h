#pragma once

// Reading Fashion-MNIST's gzipped IDX files (Debian's dataset-fashion-mnist
// installs them under /usr/share/datasets/fashion-mnist), for gpipe-train
// and gpipe-bench's accuracy table.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace gpipe_data {

/// The gzipped IDX files that a Fashion-MNIST folder holds.
constexpr const char* kFashionMnistFiles[] = {
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz"};

/// The training and test images and labels.
struct FashionMnist {
  at::Tensor train_x;  // [60000, 1, 28, 28] float, standardised
  at::Tensor train_y;  // [60000] long
  at::Tensor test_x;   // [10000, 1, 28, 28]
  at::Tensor test_y;   // [10000]
};

/// The first entries of an IDX file, and how many its header says it has.
struct Idx {
  at::Tensor data;
  int64_t count = 0;
};

/// The first `limit` entries of one IDX file (all of them where `limit` is
/// 0 or more than there are; only those are decompressed): images as
/// [N, 1, H, W] floats scaled to [0, 1] and standardised with the training
/// set's mean and deviation, or labels as [N] longs. Throws c10::ValueError
/// naming the file when it is missing, not IDX of that kind, or shorter (or,
/// read whole, longer) than its header says.
Idx read_idx(const std::string& path, bool images, int64_t limit = 0);

/// The four files under `dir`, checked to agree in length and be
/// non-empty; the first `train_limit` training and `test_limit` test
/// entries (0: all).
FashionMnist read_fashion_mnist(
    const std::string& dir, int64_t train_limit = 0, int64_t test_limit = 0);

}  // namespace gpipe_data
