// profile_times and profile_sizes: every layer in turn, on copies, timed or
// with its allocations counted.

#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/balance.h>
#include <gpipe/skip.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/utils.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "balance/allocator.h"
#include "balance/sandbox.h"
#include "packet.h"
#include "skip.h"

namespace gpipe {

namespace {

using detail::call_layer;
using detail::check_module;
using detail::CountingAllocatorScope;
using detail::CountingWindow;
using detail::CpuGeneratorAside;
using detail::layer_input;
using detail::Packet;
using detail::ProfiledLayer;
using detail::ProfileSkipTracker;
using detail::Sandbox;

// Waits for the work queued on `device` (nothing to wait for on CPU).
void synchronize(const torch::Device& device) {
  if (device.is_cpu()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.getStream(device).synchronize();
}

// Before anything runs there: LibTorch's own errors for a device it cannot
// reach say neither what was expected nor, for the meta device, the device
// at all (a layer that "cannot be cloned").
void check_device(const torch::Device& device) {
  TORCH_CHECK_VALUE(
      device.is_cpu() || device.is_cuda(),
      "device must be the CPU or a CUDA device, but got ",
      device);
  if (!device.is_cuda()) {
    return;
  }
  TORCH_CHECK_VALUE(
      at::hasCUDA(),
      "this LibTorch has no CUDA: device is ",
      device,
      ", but LibTorch was built for the CPU only; profile on torch::kCPU, or "
      "build against a CUDA LibTorch");
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  TORCH_CHECK_INDEX(
      !device.has_index() || device.index() < count,
      "device is ",
      device,
      ", but this machine has ",
      count,
      count == 1 ? " CUDA device" : " CUDA devices");
}

// `device` with an index: the current one of its type when it has none.
torch::Device with_index(torch::Device device) {
  if (device.is_cpu() || device.has_index()) {
    return device;
  }
  return c10::impl::VirtualGuardImpl(device.type()).getDevice();
}

std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// "an input of shape [8, 10]", or of shapes (..., ...) for a tuple: what a
// layer that refuses its input was given.
std::string input_shapes(const Packet& x) {
  std::ostringstream out;
  out << (x.tensors.size() == 1 ? "an input of shape " : "inputs of shapes (");
  for (const auto k : c10::irange(x.tensors.size())) {
    out << (k == 0 ? "" : ", ")
        << (x.tensors[k].defined() ? shape_of(x.tensors[k]) : "undefined");
  }
  out << (x.tensors.size() == 1 ? "" : ")");
  return out.str();
}

// `sample` as an Packet; every tensor defined and non-empty.
Packet sample_of(const std::vector<torch::Tensor>& sample, bool atomic) {
  TORCH_CHECK_VALUE(
      !sample.empty(),
      "sample must hold at least one tensor, but got an empty list");
  for (const auto k : c10::irange(sample.size())) {
    TORCH_CHECK_VALUE(
        sample[k].defined(),
        "sample must be defined tensors, but tensor ",
        k,
        " is undefined");
    TORCH_CHECK_VALUE(
        sample[k].numel() > 0,
        "sample must be non-empty tensors, but tensor ",
        k,
        " has shape ",
        shape_of(sample[k]));
  }
  return Packet{sample, atomic};
}

// Tensors on `device`, fit for autograd: an inference tensor (made under
// c10::InferenceMode) cannot be saved for backward, so it is copied.
Packet prepared(const Packet& a, const torch::Device& device) {
  Packet out{{}, a.atomic};
  for (const auto& t : a.tensors) {
    auto moved = t.to(device);
    if (moved.is_inference()) {
      moved = moved.clone();
    }
    out.tensors.push_back(moved.detach().requires_grad_(t.requires_grad()));
  }
  return out;
}

std::vector<torch::Tensor> backward_roots(
    const Packet& output, std::vector<torch::Tensor> roots) {
  for (const auto& y : output.tensors) {
    if (y.defined() && y.requires_grad()) {
      roots.push_back(y);
    }
  }
  return roots;
}

using Clock = std::chrono::steady_clock;

std::vector<double> profile_times_impl(
    const torch::nn::Sequential& module,
    const Packet& sample,
    double timeout,
    torch::Device device) {
  check_module(module);
  TORCH_CHECK_VALUE(
      timeout >= 0 && std::isfinite(timeout),
      "timeout must be a non-negative number of seconds, but got ",
      timeout);
  verify_skippables(module);
  check_device(device);
  device = with_index(device);

  // Profiling trains: grad mode on, inference mode off, whatever the caller
  // has set.
  c10::InferenceMode no_inference(/*enabled=*/false);
  torch::AutoGradMode grad_mode(/*enabled=*/true);
  c10::OptionalDeviceGuard device_guard;
  if (!device.is_cpu()) {
    device_guard.reset_device(device);
  }
  CpuGeneratorAside rng(device);

  const Packet start = prepared(sample, device);
  Sandbox sandbox(module, device);
  const auto n = sandbox.size();
  std::vector<double> first(n, 0.0);
  std::vector<double> rest(n, 0.0);
  int64_t passes = 0;
  const auto begun = Clock::now();
  do {
    auto& times = passes == 0 ? first : rest;
    ProfileSkipTracker tracker;
    detail::SkipTrackerGuard tracker_guard(&tracker);
    Packet x = start;
    for (const auto k : c10::irange(n)) {
      ProfiledLayer layer(sandbox, k);
      x = layer_input(x);
      tracker.begin_layer(static_cast<int64_t>(k));
      synchronize(device);
      const auto tick = Clock::now();
      Packet y;
      try {
        y = call_layer(layer.module(), x, k);
        auto roots = backward_roots(y, tracker.end_layer());
        if (!roots.empty()) {
          // The values as their own gradient, as torchgpipe: any gradient
          // of the right shape costs the same.
          std::vector<torch::Tensor> grads;
          for (const auto& r : roots) {
            grads.push_back(r.detach());
          }
          torch::autograd::backward(roots, grads);
        }
      } catch (c10::Error& e) {
        TORCH_RETHROW(
            e,
            "while profiling the time of layer ",
            k,
            " ('",
            sandbox.name(k),
            "') on ",
            input_shapes(x));
      }
      synchronize(device);
      times[k] += std::chrono::duration<double>(Clock::now() - tick).count();
      x = std::move(y);
    }
    ++passes;
  } while (std::chrono::duration<double>(Clock::now() - begun).count() <
           timeout);
  // The first pass pays for one-time work (allocator growth, kernel
  // selection, lazy initialisation); count it only when it is all there is.
  // The mean of the counted passes: one pass's seconds, whatever the
  // timeout.
  if (passes == 1) {
    return first;
  }
  for (auto& t : rest) {
    t /= static_cast<double>(passes - 1);
  }
  return rest;
}

int64_t parameter_bytes(const torch::nn::Module& layer) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t bytes = 0;
  for (const auto& p : layer.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) {
      bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
  }
  return bytes;
}

std::vector<double> profile_sizes_impl(
    const torch::nn::Sequential& module,
    const Packet& input,
    int64_t chunks,
    double param_scale,
    const torch::Device& device) {
  check_module(module);
  TORCH_CHECK_VALUE(
      device.is_cpu(),
      "sizes are profiled on CPU (by counting LibTorch's CPU allocations), "
      "so device must be CPU, but got ",
      device,
      "; profile sizes on CPU, or use balance_by_time on ",
      device);
  TORCH_CHECK_VALUE(
      chunks >= 1, "chunks must be a positive integer, but got ", chunks);
  TORCH_CHECK_VALUE(
      param_scale >= 0 && std::isfinite(param_scale),
      "param_scale must be a finite non-negative number, but got ",
      param_scale);
  for (const auto k : c10::irange(input.tensors.size())) {
    TORCH_CHECK_VALUE(
        input.tensors[k].dim() >= 1,
        "input must have a batch dimension (dim 0), but tensor ",
        k,
        " is a scalar");
  }
  const int64_t batch = input.tensors[0].size(0);
  for (const auto k : c10::irange(input.tensors.size())) {
    TORCH_CHECK_VALUE(
        input.tensors[k].size(0) == batch,
        "every input tensor must have the same batch size (dim 0): tensor 0 "
        "has ",
        batch,
        " but tensor ",
        k,
        " has ",
        input.tensors[k].size(0));
  }
  verify_skippables(module);

  // One micro-batch as scatter() cuts them (the first is the largest), its
  // latent memory scaled to batch / chunks rows as torchgpipe does from one
  // row. A whole micro-batch, not one row: BatchNorm refuses one row in
  // training, and per-forward memory that does not grow with the batch is
  // not multiplied.
  const int64_t rows = batch / chunks + (batch % chunks != 0 ? 1 : 0);
  const double latent_scale = static_cast<double>(batch) /
                              static_cast<double>(chunks) /
                              static_cast<double>(rows);

  c10::InferenceMode no_inference(/*enabled=*/false);
  torch::AutoGradMode grad_mode(/*enabled=*/true);
  CpuGeneratorAside rng(device);

  Packet micro{{}, input.atomic};
  for (const auto& t : input.tensors) {
    micro.tensors.push_back(t.narrow(0, 0, rows));
  }
  Packet x = prepared(micro, device);
  Sandbox sandbox(module, device);
  std::vector<double> sizes;
  ProfileSkipTracker tracker;
  detail::SkipTrackerGuard tracker_guard(&tracker);
  CountingAllocatorScope counting;
  size_t k = 0;
  for (const auto& child : module->children()) {
    ProfiledLayer layer(sandbox, k);
    x = layer_input(x);
    tracker.begin_layer(static_cast<int64_t>(k));
    int64_t latent = 0;
    try {
      CountingWindow window;
      Packet y = call_layer(layer.module(), x, k);
      latent = window.bytes();
      x = std::move(y);
    } catch (c10::Error& e) {
      TORCH_RETHROW(
          e,
          "while profiling the size of layer ",
          k,
          " ('",
          sandbox.name(k),
          "') on ",
          input_shapes(x));
    }
    tracker.end_layer();
    sizes.push_back(
        static_cast<double>(latent) * latent_scale +
        static_cast<double>(parameter_bytes(*child)) * param_scale);
    ++k;
  }
  return sizes;
}

}  // namespace

std::vector<double> profile_times(
    torch::nn::Sequential module,
    torch::Tensor sample,
    double timeout,
    torch::Device device) {
  return profile_times_impl(
      module, sample_of({std::move(sample)}, /*atomic=*/true), timeout, device);
}

std::vector<double> profile_times(
    torch::nn::Sequential module,
    std::vector<torch::Tensor> sample,
    double timeout,
    torch::Device device) {
  return profile_times_impl(
      module, sample_of(sample, /*atomic=*/false), timeout, device);
}

std::vector<double> profile_sizes(
    torch::nn::Sequential module,
    torch::Tensor input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  return profile_sizes_impl(
      module,
      sample_of({std::move(input)}, /*atomic=*/true),
      chunks,
      param_scale,
      device);
}

std::vector<double> profile_sizes(
    torch::nn::Sequential module,
    std::vector<torch::Tensor> input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  return profile_sizes_impl(
      module, sample_of(input, /*atomic=*/false), chunks, param_scale, device);
}

}  // namespace gpipe
