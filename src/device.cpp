#include "device.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "engine/lane_threads.h"

namespace gpipe::detail {

std::vector<torch::Device> default_devices(int64_t partitions) {
  const auto cuda = static_cast<int64_t>(torch::cuda::device_count());
  std::vector<torch::Device> devices;
  if (cuda > 0) {
    for (const auto d : c10::irange(cuda)) {
      devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(d));
    }
  } else {
    devices.assign(partitions, torch::Device(torch::kCPU));
  }
  return devices;
}

torch::Device normalize_device(torch::Device device) {
  if (device.is_cuda() && !device.has_index()) {
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(0));
  }
  return device;
}

int64_t available_cores() {
  // As LibTorch's own default count: OMP_NUM_THREADS caps what a process
  // uses (the first number of a list; anything else is ignored).
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long value = std::strtol(env, &end, 10);
    if (end != env && value > 0) {
      return value;
    }
  }
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

int64_t threads_per_lane(
    int64_t requested, const std::vector<torch::Device>& devices) {
  if (requested > 0) {
    return requested;
  }
  const auto cpu_lanes = std::count_if(
      devices.begin(), devices.end(), [](const auto& d) { return d.is_cpu(); });
  const int64_t cores = available_cores();
  return std::max<int64_t>(1, cores / std::max<int64_t>(1, cpu_lanes));
}

std::function<void()> lane_init(torch::Device device, int64_t threads) {
  if (!device.is_cpu()) {
    return {};
  }
  return [threads] {
    // Initialise this thread's intra-op pool first, so that the lazy
    // initialisation of the first parallel op does not undo our count.
    at::internal::lazy_init_num_threads();
    // This thread's count only: at::set_num_threads would also change the
    // count that other threads start with, the caller's included when it
    // has not run a parallel op yet (Note [Threads that follow the plan]).
    set_intra_op_threads(threads);
  };
}

}  // namespace gpipe::detail
