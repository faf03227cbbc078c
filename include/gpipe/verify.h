#pragma once

// Configuration checks. Every check GPipe makes at construction lives here as
// a pure function, so tests and tools can call them before building anything.
// Each throws c10::Error (ValueError / TypeError / IndexError) naming the
// argument, the expected and the actual value.

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe {

/// `balance` has no entry below 1 and sums to `num_layers`.
void verify_balance(const std::vector<int64_t>& balance, int64_t num_layers);

/// `chunks` is at least 1.
void verify_chunks(int64_t chunks);

/// There is a device for each of the `lanes` lanes that hold the
/// partitions, each used one is the CPU or a CUDA device, and every CUDA
/// device among them exists (a LibTorch built without CUDA has none). The
/// lanes are what the constructor counts: the partitions, over
/// stages_per_lane, or `placement.lanes()` (2 for Placement({0, 0, 1, 1})).
void verify_devices(const std::vector<torch::Device>& devices, int64_t lanes);

/// No module appears twice and no parameter is shared between children.
void verify_module(const torch::nn::Sequential& module);

/// A non-empty list of defined tensors sharing one non-zero batch size.
void verify_batch(const std::vector<torch::Tensor>& inputs);

}  // namespace gpipe
