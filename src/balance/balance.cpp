// The public entry points: a balance from profiled costs.

#include <c10/util/Exception.h>
#include <gpipe/balance.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "balance/sandbox.h"
#include "text.h"

namespace gpipe {

namespace {

using detail::check_module;

void check_partitions(int64_t partitions, const torch::nn::Sequential& module) {
  TORCH_CHECK_VALUE(
      partitions >= 1,
      "partitions must be a positive integer, but got ",
      partitions);
  check_module(module);
  const auto layers = static_cast<int64_t>(module->size());
  TORCH_CHECK_VALUE(
      partitions <= layers,
      "partitions must not exceed the number of layers: expected at most ",
      detail::count_of(layers, "partition", "partitions"),
      " for a module of ",
      detail::count_of(layers, "layer", "layers"),
      ", but got ",
      partitions);
}

}  // namespace

// The same for a single-tensor and a tuple sample: profile, then split.
template <typename Sample>
std::vector<int64_t> by_time(
    int64_t partitions,
    const torch::nn::Sequential& module,
    Sample sample,
    double timeout,
    torch::Device device) {
  check_partitions(partitions, module);
  return balance_cost(
      profile_times(module, std::move(sample), timeout, device), partitions);
}

template <typename Sample>
std::vector<int64_t> by_size(
    int64_t partitions,
    const torch::nn::Sequential& module,
    Sample input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  check_partitions(partitions, module);
  return balance_cost(
      profile_sizes(module, std::move(input), chunks, param_scale, device),
      partitions);
}

std::vector<int64_t> balance_by_time(
    int64_t partitions,
    torch::nn::Sequential module,
    torch::Tensor sample,
    double timeout,
    torch::Device device) {
  return by_time(partitions, module, std::move(sample), timeout, device);
}

std::vector<int64_t> balance_by_time(
    int64_t partitions,
    torch::nn::Sequential module,
    std::vector<torch::Tensor> sample,
    double timeout,
    torch::Device device) {
  return by_time(partitions, module, std::move(sample), timeout, device);
}

std::vector<int64_t> balance_by_size(
    int64_t partitions,
    torch::nn::Sequential module,
    torch::Tensor input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  return by_size(
      partitions, module, std::move(input), chunks, param_scale, device);
}

std::vector<int64_t> balance_by_size(
    int64_t partitions,
    torch::nn::Sequential module,
    std::vector<torch::Tensor> input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  return by_size(
      partitions, module, std::move(input), chunks, param_scale, device);
}

}  // namespace gpipe
