#pragma once

// Devices and lanes: the default placement, the one rule for a CUDA device
// without an index, and the split of intra-op threads between CPU lanes.

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace gpipe::detail {

/// Every CUDA device when there is one (partitions beyond them are refused
/// by verify_devices), else one CPU lane per partition.
std::vector<torch::Device> default_devices(int64_t partitions);

/// "cuda" means CUDA device 0 (guards and streams need an index); every
/// other device is returned as it is.
torch::Device normalize_device(torch::Device device);

/// The cores the lanes share: OMP_NUM_THREADS when it is set to a positive
/// count (as LibTorch's default intra-op count), else the hardware's
/// threads, at least 1.
int64_t available_cores();

/// The most intra-op threads a lane may be given: each is a thread of
/// LibTorch's pool, made at once.
constexpr int64_t kMaxThreadsPerLane = 1024;

/// Intra-op threads per CPU lane: `requested` when positive, else the cores
/// shared out between the CPU lanes (at least one each), so that lanes x
/// threads fits the machine.
int64_t threads_per_lane(
    int64_t requested, const std::vector<torch::Device>& devices);

/// What a lane's thread runs first: on a CPU lane, sets this thread's
/// intra-op thread count to `threads`.
std::function<void()> lane_init(torch::Device device, int64_t threads);

}  // namespace gpipe::detail
