#include "random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/torch.h>

#include <mutex>

namespace gpipe::detail {

namespace {

// The lease is process-wide because the generators are. See Note [Random
// streams of concurrent cells].
std::mutex& lease() {
  static std::mutex mutex;
  return mutex;
}

std::vector<torch::Device> generator_devices(torch::Device device) {
  std::vector<torch::Device> devices{torch::kCPU};
  if (device.type() != torch::kCPU) {
    devices.push_back(device);
  }
  return devices;
}

at::Generator generator_of(torch::Device device) {
  return at::globalContext().defaultGenerator(device);
}

std::vector<torch::Tensor> states_of(
    const std::vector<torch::Device>& devices) {
  std::vector<torch::Tensor> states;
  for (const auto& d : devices) {
    auto gen = generator_of(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.push_back(gen.get_state());
  }
  return states;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

void RandomUse::run_seeded(
    torch::Device device,
    bool training,
    uint64_t seed,
    const std::function<void()>& fn) {
  auto& state = state_[training ? 1 : 0];
  const int known = state.load();
  if (known == kNever) {
    fn();
    return;
  }
  std::lock_guard<std::mutex> hold(lease());
  const auto devices = generator_devices(device);
  for (const auto& d : devices) {
    auto gen = generator_of(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  if (known == kDraws) {
    fn();
    return;
  }
  const auto before = states_of(devices);
  fn();
  const auto after = states_of(devices);
  bool drew = false;
  for (size_t k = 0; k < before.size(); ++k) {
    drew = drew || !torch::equal(before[k], after[k]);
  }
  state.store(drew ? kDraws : kNever);
}

uint64_t draw_step_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

uint64_t cell_seed(uint64_t step_seed, int64_t micro_batch, int64_t partition) {
  return splitmix64(
      splitmix64(step_seed ^ static_cast<uint64_t>(micro_batch)) ^
      (static_cast<uint64_t>(partition) << 32));
}

GeneratorStateGuard::GeneratorStateGuard(
    const std::vector<torch::Device>& devices) {
  devices_.push_back(torch::kCPU);
  for (const auto& d : devices) {
    if (d.type() != torch::kCPU &&
        std::find(devices_.begin(), devices_.end(), d) == devices_.end()) {
      devices_.push_back(d);
    }
  }
  states_ = states_of(devices_);
}

GeneratorStateGuard::~GeneratorStateGuard() {
  for (size_t k = 0; k < devices_.size(); ++k) {
    auto gen = generator_of(devices_[k]);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(states_[k]);
  }
}

}  // namespace gpipe::detail
