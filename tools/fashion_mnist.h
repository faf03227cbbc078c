#pragma once

// Reading Fashion-MNIST's gzipped IDX files (Debian's dataset-fashion-mnist
// installs them under /usr/share/datasets/fashion-mnist), for gpipe-train
// and gpipe-bench's accuracy table.

#include <ATen/core/Tensor.h>

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

/// One IDX file: images as [N, 1, H, W] floats scaled to [0, 1] and
/// standardised with the training set's mean and deviation, or labels as
/// [N] longs. Throws c10::ValueError naming the file when it is missing,
/// not IDX of that kind, or truncated.
at::Tensor read_idx(const std::string& path, bool images);

/// The four files under `dir`, checked to agree in length and be
/// non-empty.
FashionMnist read_fashion_mnist(const std::string& dir);

}  // namespace gpipe_data
