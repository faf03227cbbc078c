#pragma once

// The small timing and memory helpers every gpipe benchmark shares.

#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#if defined(__unix__)
#include <sys/resource.h>
#endif

namespace gpipe::bench {

/// Median seconds of `iterations` calls of `step`, after `warmup` calls.
inline double time_median(
    const std::function<void()>& step, int warmup, int iterations) {
  for (int k = 0; k < warmup; ++k) {
    step();
  }
  std::vector<double> times;
  for (int k = 0; k < iterations; ++k) {
    const auto start = std::chrono::steady_clock::now();
    step();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

/// Seconds of each call of each of `steps`, round by round: every round
/// calls the steps once each, in order, so that a noisy neighbour slows
/// them alike; for small differences. `warmup` rounds first, untimed.
/// Returns [step][round].
inline std::vector<std::vector<double>> time_rounds(
    const std::vector<std::function<void()>>& steps, int warmup, int rounds) {
  for (int k = 0; k < warmup; ++k) {
    for (const auto& step : steps) {
      step();
    }
  }
  std::vector<std::vector<double>> times(steps.size());
  for (int k = 0; k < rounds; ++k) {
    for (size_t s = 0; s < steps.size(); ++s) {
      const auto start = std::chrono::steady_clock::now();
      steps[s]();
      times[s].push_back(std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - start)
                             .count());
    }
  }
  return times;
}

/// The value at fraction `q` (0 to 1) of `values` in order, at the nearest
/// index: for q = 0.5 the median (of an even count, the upper middle one).
inline double quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * double(values.size() - 1) + 0.5)];
}

/// The median of `values` (of an even count, the upper middle one).
inline double median(std::vector<double> values) {
  return quantile(std::move(values), 0.5);
}

/// Seconds on the steady clock since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

/// The CPU time this process has used so far (every thread, user and
/// system), in seconds; 0 where the platform does not say.
inline double process_cpu_seconds() {
#if defined(__unix__)
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) *
             1e-6;
#else
  return 0;
#endif
}

/// The mean squared error, the loss of the benchmarks' regression models.
inline torch::Tensor mse(torch::Tensor out, torch::Tensor target) {
  return torch::mse_loss(out, target);
}

/// Median seconds of `a` and of `b`, timed in alternation (a, b, a, b,
/// ...) as time_rounds does.
inline std::pair<double, double> time_paired(
    const std::function<void()>& a,
    const std::function<void()>& b,
    int warmup,
    int iterations) {
  const auto times = time_rounds({a, b}, warmup, iterations);
  return {quantile(times[0], 0.5), quantile(times[1], 0.5)};
}

/// Prints what the numbers depend on: device, BLAS, threads.
inline void print_environment() {
  std::printf(
      "# device: cpu, %u hardware threads\n",
      std::thread::hardware_concurrency());
  std::string config = at::show_config();
  const auto blas = config.find("BLAS_INFO=");
  std::printf(
      "# blas: %s\n",
      blas == std::string::npos
          ? "unknown"
          : config.substr(blas, config.find_first_of(", \n", blas) - blas)
                .c_str());
  std::printf("# %s", at::get_parallel_info().c_str());
}

/// The tag a thread's allocations are counted under (CountingAllocator's
/// per-tag counts): 0 unless the thread sets it. The U-Net memory table
/// gives each lane a tag of its own, so that each lane's peak stands for
/// the memory of one device.
inline thread_local int allocation_tag = 0;

/// Counts the bytes of live CPU tensors, and their peak, by wrapping
/// LibTorch's CPU allocator; in all, and per allocation_tag.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& install() {
    static CountingAllocator* instance = [] {
      auto* a = new CountingAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(a, /*priority=*/100);
      return a;
    }();
    return *instance;
  }

  // Each block carries its size in a header before the data, so that the
  // data pointer is its own context and raw_allocate (which some kernels,
  // such as convolutions, use) works.
  c10::DataPtr allocate(size_t n) const override {
    auto* raw = static_cast<char*>(base_->raw_allocate(n + kHeader));
    const int tag = allocation_tag >= 0 && allocation_tag < kTags
                        ? allocation_tag
                        : kTags - 1;
    *reinterpret_cast<size_t*>(raw) = n;
    *reinterpret_cast<int*>(raw + sizeof(size_t)) = tag;
    raise(peak_, live_.fetch_add(n) + n);
    raise(tag_peak_[tag], tag_live_[tag].fetch_add(n) + n);
    void* data = raw + kHeader;
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  /// Starts a new peak from what is live now; returns that baseline.
  size_t reset_peak() {
    const auto now = live_.load();
    peak_.store(now);
    return now;
  }
  size_t peak() const {
    return peak_.load();
  }

  /// The same per tag: starts every tag's peak from its live bytes.
  void reset_tag_peaks() {
    for (int k = 0; k < kTags; ++k) {
      tag_peak_[k].store(tag_live_[k].load());
    }
  }
  /// Peak live bytes of the allocations made under `tag` (in
  /// 0 .. kTags - 2; the last tag counts every other one).
  size_t tag_peak(int tag) const {
    return tag_peak_[tag].load();
  }
  /// Live bytes of the allocations made under `tag`.
  size_t tag_live(int tag) const {
    return tag_live_[tag].load();
  }
  static constexpr int kTags = 16;

 private:
  static void raise(std::atomic<size_t>& peak, size_t now) {
    auto seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }
  // Keeps the data 64-byte aligned, as the CPU allocator's is.
  static constexpr size_t kHeader = 64;
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  static void release(void* data) {
    if (data == nullptr) {
      return;
    }
    auto* raw = static_cast<char*>(data) - kHeader;
    auto& self = install();
    const auto n = *reinterpret_cast<size_t*>(raw);
    self.live_.fetch_sub(n);
    self.tag_live_[*reinterpret_cast<int*>(raw + sizeof(size_t))].fetch_sub(n);
    self.base_->raw_deallocate(raw);
  }

  c10::Allocator* base_;
  mutable std::atomic<size_t> live_{0};
  mutable std::atomic<size_t> peak_{0};
  mutable std::atomic<size_t> tag_live_[kTags] = {};
  mutable std::atomic<size_t> tag_peak_[kTags] = {};
};

/// An identity layer that puts its thread's allocations under `tag`: placed
/// first in a partition, it tags that partition's lane (on CPU a lane runs
/// its partitions' forward, recomputation and backward alike). With
/// `copy_input`, it returns a copy of its input made under the new tag, as
/// a device holds what it receives: otherwise a partition's input stays
/// charged to the lane that made it.
struct LaneTagImpl : torch::nn::Module {
  explicit LaneTagImpl(int tag, bool copy_input = false)
      : tag(tag), copy_input(copy_input) {}
  torch::Tensor forward(torch::Tensor x) {
    allocation_tag = tag;
    return copy_input ? x.clone() : x;
  }
  int tag;
  bool copy_input;
};
TORCH_MODULE(LaneTag);

/// The same for the gradient coming back: an identity layer whose backward
/// copies the gradient it receives on the thread that runs it. Placed last
/// in a partition, it charges the gradient from the next lane to this
/// partition's lane, which holds it (a weight part waiting with it keeps
/// it there): otherwise it stays charged to the lane that computed it.
struct CopyGradientImpl : torch::nn::Module {
  struct Copy : torch::autograd::Function<Copy> {
    static torch::Tensor forward(
        torch::autograd::AutogradContext* /*ctx*/, torch::Tensor x) {
      return x.view_as(x);
    }
    static torch::autograd::variable_list backward(
        torch::autograd::AutogradContext* /*ctx*/,
        torch::autograd::variable_list grads) {
      return {grads[0].clone()};
    }
  };
  torch::Tensor forward(torch::Tensor x) {
    return Copy::apply(x);
  }
};
TORCH_MODULE(CopyGradient);

// One training step (forward, loss, backward) of any module.
template <typename M>
std::function<void()> train_step(M& model, const torch::Tensor& x) {
  return [&model, x] {
    model->zero_grad();
    model->forward(x).pow(2).mean().backward();
  };
}

/// Peak bytes allocated above the baseline while `step` runs.
inline double peak_mib(const std::function<void()>& step) {
  auto& counter = CountingAllocator::install();
  const auto base = counter.reset_peak();
  step();
  return double(counter.peak() - base) / (1024.0 * 1024.0);
}

/// `blocks` x (Linear(width, width) + ReLU): the benchmarks' model.
inline torch::nn::Sequential mlp(int64_t blocks, int64_t width) {
  torch::nn::Sequential net;
  for (int64_t k = 0; k < blocks; ++k) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

/// How many micro-batches Tensor::chunk cuts `rows` rows asked for `m` into
/// (2 rows asked for 32: 2; 9 rows asked for 8: 5).
inline int64_t pieces_of(int64_t rows, int64_t m) {
  const int64_t size = (rows + m - 1) / m;
  return size > 0 ? (rows + size - 1) / size : 0;
}

/// The counts of `requested` that `rows` rows cut into: a row labelled 32
/// that the batch cuts into 2 would time 2. The others are left out with a
/// line that says so.
inline std::vector<int64_t> chunk_counts_of(
    int64_t rows, const std::vector<int64_t>& requested) {
  std::vector<int64_t> kept;
  for (const auto m : requested) {
    const int64_t pieces = pieces_of(rows, m);
    if (pieces == m) {
      kept.push_back(m);
    } else {
      std::printf(
          "# chunks %lld left out: %lld rows cut into %lld micro-batches, not "
          "%lld\n",
          static_cast<long long>(m),
          static_cast<long long>(rows),
          static_cast<long long>(pieces),
          static_cast<long long>(m));
    }
  }
  return kept;
}

}  // namespace gpipe::bench
