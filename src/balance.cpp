#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/balance.h>
#include <gpipe/skip.h>
#include <torch/autograd.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/utils.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "packet.h"
#include "skip.h"

namespace gpipe {

namespace {

void check_finite(const std::vector<double>& sequence) {
  for (const auto i : c10::irange(sequence.size())) {
    TORCH_CHECK_VALUE(
        std::isfinite(sequence[i]),
        "every cost must be a finite number, but element ",
        i,
        " is ",
        sequence[i]);
  }
}

// Note [Block partition]
// Bárány and Grinberg's procedure, on values scaled to [0, 1]:
//   (1) let p be a maximal block (torchgpipe: the last of equal ones);
//   (2) stop when max <= min + 1;
//   (3) else let q be the minimal block closest to p, h the block next to q
//       towards p; move the element of h nearest q into q; go to (1) if
//       h == p, else to (2).
// torchgpipe's code takes the leftmost minimal block as q instead of the
// closest. Then h may be empty, the boundaries cross and the loop can run
// forever: solve([2, 1, 0, 0, 5, 0, 0, 4, 3], 8) never returns, and about 2%
// of random short sequences come back with blocks that do not cover the
// sequence. With the closest q, h is never empty (an empty block has size 0,
// the minimum, and would be closer). The stop test allows for rounding: with
// max == min + 1 exactly, a rounding error would otherwise move one element
// back and forth for ever.
constexpr double kStopSlack = 1e-9;

// End (exclusive) of each block.
std::vector<int64_t> block_partition_splits(
    const std::vector<double>& sequence, int64_t partitions) {
  TORCH_CHECK_VALUE(
      partitions >= 1,
      "partitions must be a positive integer (",
      partitions,
      " < 1)");
  const auto n = static_cast<int64_t>(sequence.size());
  TORCH_CHECK_VALUE(
      n >= partitions,
      "sequence is shorter than intended partitions (",
      n,
      " < ",
      partitions,
      ")");
  check_finite(sequence);

  const auto [lowest, highest] =
      std::minmax_element(sequence.begin(), sequence.end());
  const double minimum = *lowest;
  const double range = *highest - minimum;
  std::vector<double> normal(sequence.size(), 0.0);
  if (range != 0) {
    for (const auto i : c10::irange(sequence.size())) {
      normal[i] = (sequence[i] - minimum) / range;
    }
  }

  std::vector<int64_t> splits(partitions, n);
  for (const auto i : c10::irange(partitions - 1)) {
    splits[i] = n / partitions * (i + 1);
  }
  // Sums in order from the block's start, as Python's sum() over a slice, so
  // that equal blocks compare equal as they do in torchgpipe.
  auto block_size = [&](int64_t i) {
    double size = 0;
    for (int64_t j = i == 0 ? 0 : splits[i - 1]; j < splits[i]; ++j) {
      size += normal[j];
    }
    return size;
  };

  // The procedure ends after O(k n^2) moves in practice (7824 moves for
  // n = 300, k = 64); the cap only turns a bug into an error.
  const int64_t max_moves = partitions * n * n + 1000;
  int64_t moves = 0;
  std::vector<double> sizes(partitions);
  while (true) {
    int64_t p = 0;
    double max_size = block_size(0);
    for (const auto i : c10::irange(int64_t{1}, partitions)) {
      const double size = block_size(i);
      if (size >= max_size) {
        max_size = size;
        p = i;
      }
    }
    while (true) {
      for (const auto i : c10::irange(partitions)) {
        sizes[i] = block_size(i);
      }
      const double min_size = *std::min_element(sizes.begin(), sizes.end());
      if (max_size <= min_size + 1 + kStopSlack) {
        return splits;
      }
      int64_t q = -1;
      for (const auto i : c10::irange(partitions)) {
        if (sizes[i] == min_size &&
            (q < 0 || std::abs(i - p) < std::abs(q - p))) {
          q = i;
        }
      }
      int64_t h = 0;
      if (p < q) {
        h = q - 1;
        splits[h] -= 1;
      } else {
        h = q + 1;
        splits[q] += 1;
      }
      TORCH_INTERNAL_ASSERT(
          ++moves <= max_moves,
          "block partition did not converge after ",
          moves,
          " moves");
      if (p == h) {
        break;
      }
    }
  }
}

// The blocks of `splits` that minimise the largest block sum, ties broken by
// the smallest sum of squared block sums, by dynamic programming over prefix
// sums: O(k n^2).
std::vector<int64_t> min_max_splits(
    const std::vector<double>& prefix, int64_t partitions) {
  const auto n = static_cast<int64_t>(prefix.size()) - 1;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  auto sum = [&](int64_t begin, int64_t end) {
    return prefix[end] - prefix[begin];
  };
  // largest[i]: the smallest largest block sum of the first i values in j
  // blocks, for the current j.
  std::vector<double> largest(n + 1, kInf);
  for (const auto i : c10::irange(int64_t{1}, n + 1)) {
    largest[i] = sum(0, i);
  }
  for (const auto j : c10::irange(int64_t{2}, partitions + 1)) {
    std::vector<double> next(n + 1, kInf);
    for (int64_t i = j; i <= n; ++i) {
      for (int64_t t = j - 1; t < i; ++t) {
        next[i] = std::min(next[i], std::max(largest[t], sum(t, i)));
      }
    }
    largest = std::move(next);
  }
  const double bound = largest[n];

  // Among the splits whose blocks all stay within `bound` (the optimal one
  // does, its sums being the same floating-point differences), the one with
  // the smallest sum of squares.
  std::vector<std::vector<int64_t>> from(
      partitions + 1, std::vector<int64_t>(n + 1, -1));
  std::vector<double> squares(n + 1, kInf);
  for (const auto i : c10::irange(int64_t{1}, n + 1)) {
    if (sum(0, i) <= bound) {
      squares[i] = sum(0, i) * sum(0, i);
      from[1][i] = 0;
    }
  }
  for (const auto j : c10::irange(int64_t{2}, partitions + 1)) {
    std::vector<double> next(n + 1, kInf);
    for (int64_t i = j; i <= n; ++i) {
      for (int64_t t = j - 1; t < i; ++t) {
        const double block = sum(t, i);
        if (squares[t] == kInf || block > bound) {
          continue;
        }
        const double total = squares[t] + block * block;
        if (total < next[i]) {
          next[i] = total;
          from[j][i] = t;
        }
      }
    }
    squares = std::move(next);
  }
  std::vector<int64_t> splits(partitions);
  int64_t end = n;
  for (int64_t j = partitions; j >= 1; --j) {
    TORCH_INTERNAL_ASSERT(from[j][end] >= 0, "no split within the bound");
    splits[j - 1] = end;
    end = from[j][end];
  }
  TORCH_INTERNAL_ASSERT(end == 0);
  return splits;
}

double largest_block(
    const std::vector<double>& prefix, const std::vector<int64_t>& splits) {
  double largest = -std::numeric_limits<double>::infinity();
  int64_t begin = 0;
  for (const auto end : splits) {
    largest = std::max(largest, prefix[end] - prefix[begin]);
    begin = end;
  }
  return largest;
}

bool has_empty_block(const std::vector<int64_t>& splits) {
  int64_t begin = 0;
  for (const auto end : splits) {
    if (end <= begin) {
      return true;
    }
    begin = end;
  }
  return false;
}

// ---------------------------------------------------------------------------
// Running layers one by one.

using detail::Packet;

torch::Tensor detach_keeping_requires_grad(const torch::Tensor& t) {
  return t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t;
}

Packet detached(const Packet& a) {
  Packet out{{}, a.atomic};
  out.tensors.reserve(a.tensors.size());
  for (const auto& t : a.tensors) {
    out.tensors.push_back(detach_keeping_requires_grad(t));
  }
  return out;
}

Packet call_layer(
    torch::nn::AnyModule& layer, const Packet& input, size_t index) {
  return detail::packet_of(
      input.atomic ? layer.any_forward(input.tensors.at(0))
                   : layer.any_forward(input.tensors),
      "layer",
      static_cast<int64_t>(index));
}

// Skips while profiling: each stash is kept detached (requiring grad as the
// stashed tensor did), so a later layer's pop starts a graph of its own and
// each layer's backward stays inside that layer, as each cell's does in the
// pipeline. While the stashing layer runs, the stashed tensor itself is kept
// too: a pop inside the same layer gets it, and otherwise it is a root of
// that layer's backward (the gradient the skip would bring back).
class ProfileSkipTracker final : public detail::SkipTracker {
 public:
  void begin_layer(int64_t layer) {
    layer_ = layer;
  }

  // The stashed tensors of the current layer that a backward should start
  // from; forgets them, so that their graphs can go.
  std::vector<torch::Tensor> end_layer() {
    std::vector<torch::Tensor> roots;
    for (auto& entry : entries_) {
      auto& attached = entry.second.attached;
      if (attached.defined() && attached.requires_grad() &&
          entry.second.layer == layer_) {
        roots.push_back(attached);
      }
      attached = torch::Tensor();
    }
    return roots;
  }

  void stash(const SkipKey& key, torch::Tensor tensor) override {
    auto copy = detach_keeping_requires_grad(tensor);
    entries_.insert_or_assign(
        key, Entry{layer_, std::move(tensor), std::move(copy)});
  }

  torch::Tensor pop(const SkipKey& key) override {
    auto it = entries_.find(key);
    TORCH_CHECK(it != entries_.end(), "'", key.name, "' has not been stashed");
    auto entry = std::move(it->second);
    entries_.erase(it);
    if (entry.layer == layer_) {
      return entry.attached;
    }
    return entry.detached;
  }

 private:
  struct Entry {
    int64_t layer = -1;
    torch::Tensor attached;
    torch::Tensor detached;
  };
  int64_t layer_ = -1;
  std::map<SkipKey, Entry> entries_;
};

// The layers of the user's module and how to get a copy of each to profile.
class Sandbox {
 public:
  Sandbox(const torch::nn::Sequential& module, torch::Device device)
      : device_(device) {
    for (const auto& item : module->named_children()) {
      names_.push_back(item.key());
    }
    for (auto it = module->begin(); it != module->end(); ++it) {
      layers_.push_back(&*it);
    }
    TORCH_INTERNAL_ASSERT(names_.size() == layers_.size());
    clone_error_.resize(layers_.size());
    cloneable_.assign(layers_.size(), kUnknown);
  }

  size_t size() const {
    return layers_.size();
  }
  const std::string& name(size_t k) const {
    return names_[k];
  }

 private:
  friend class ProfiledLayer;
  enum Cloneable : int8_t { kUnknown, kYes, kNo };

  torch::Device device_;
  std::vector<const torch::nn::AnyModule*> layers_;
  std::vector<std::string> names_;
  std::vector<int8_t> cloneable_;
  std::vector<std::string> clone_error_;
};

// Note [Profiling without touching the module]
// A layer that clones (torch::nn::Cloneable) is profiled as a fresh clone on
// the profiling device, made anew for every pass (as torchgpipe deep-copies
// it), so at most one layer is copied at a time and the original is never
// run. A layer that does not clone (a plain torch::nn::Module throws in
// clone()) runs itself: its parameter values, buffers, gradients and
// training flags are saved first and put back afterwards, and its gradients
// are set aside (undefined) while it runs, so that profiling neither reads
// nor adds to them. Values go back through variable_data(), which does not
// bump version counters a pending backward of the user may check.
class ProfiledLayer {
 public:
  ProfiledLayer(Sandbox& sandbox, size_t k) {
    const auto& original = *sandbox.layers_[k];
    auto& cloneable = sandbox.cloneable_[k];
    if (cloneable != Sandbox::kNo) {
      try {
        module_ = original.clone(sandbox.device_);
        cloneable = Sandbox::kYes;
      } catch (const c10::Error& e) {
        if (cloneable == Sandbox::kYes) {
          throw;
        }
        cloneable = Sandbox::kNo;
        sandbox.clone_error_[k] = e.what_without_backtrace();
      }
    }
    if (cloneable == Sandbox::kYes) {
      // Cloneable::clone() re-creates parameters in reset(), requiring grad
      // whatever the original's flag: frozen parameters stay frozen.
      const auto originals = original.ptr()->named_parameters();
      for (auto& item : module_.ptr()->named_parameters()) {
        if (const auto* p = originals.find(item.key())) {
          item.value().requires_grad_(p->requires_grad());
        }
      }
      module_.ptr()->train(true);
      return;
    }
    check_device(sandbox, k, *original.ptr());
    module_ = original;
    save(*original.ptr());
    module_.ptr()->train(true);
  }

  ~ProfiledLayer() {
    if (!saved_) {
      return;
    }
    try {
      restore();
    } catch (const std::exception& e) {
      TORCH_WARN(
          "gpipe balance: could not restore the state of a layer after "
          "profiling it: ",
          e.what());
    }
  }

  ProfiledLayer(const ProfiledLayer&) = delete;
  ProfiledLayer& operator=(const ProfiledLayer&) = delete;

  torch::nn::AnyModule& module() {
    return module_;
  }

 private:
  struct SavedState {
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    std::vector<bool> training;
    std::vector<torch::Tensor> parameters;
    std::vector<torch::Tensor> values;
    std::vector<torch::Tensor> grads;
    std::vector<torch::Tensor> buffers;
    std::vector<torch::Tensor> buffer_values;
  };

  static void check_device(
      const Sandbox& sandbox, size_t k, const torch::nn::Module& layer) {
    auto check = [&](const torch::Tensor& t) {
      TORCH_CHECK_VALUE(
          !t.defined() || t.device() == sandbox.device_,
          "layer ",
          k,
          " ('",
          sandbox.names_[k],
          "', ",
          layer.name(),
          ") cannot be cloned (",
          sandbox.clone_error_[k],
          "), so it is profiled in place, which needs its parameters and "
          "buffers on the profiling device ",
          sandbox.device_,
          ", but one is on ",
          t.device(),
          "; profile on ",
          t.device(),
          " or derive the layer from torch::nn::Cloneable");
    };
    for (const auto& p : layer.parameters()) {
      check(p);
    }
    for (const auto& b : layer.buffers()) {
      check(b);
    }
  }

  void save(torch::nn::Module& layer) {
    torch::NoGradGuard no_grad;
    saved_ = std::make_unique<SavedState>();
    // Pre-order (the layer first), so that restoring in this order leaves
    // every module with its own flag although train() recurses.
    saved_->modules = layer.modules(/*include_self=*/true);
    for (const auto& m : saved_->modules) {
      saved_->training.push_back(m->is_training());
    }
    for (auto& p : layer.parameters()) {
      saved_->parameters.push_back(p);
      saved_->values.push_back(p.detach().clone());
      saved_->grads.push_back(p.grad());
      p.mutable_grad() = torch::Tensor();
    }
    for (auto& b : layer.buffers()) {
      saved_->buffers.push_back(b);
      saved_->buffer_values.push_back(
          b.defined() ? b.detach().clone() : torch::Tensor());
    }
  }

  void restore() {
    torch::NoGradGuard no_grad;
    auto saved = std::move(saved_);
    for (const auto i : c10::irange(saved->parameters.size())) {
      auto& p = saved->parameters[i];
      if (!p.equal(saved->values[i])) {
        p.variable_data().copy_(saved->values[i]);
      }
      p.mutable_grad() = saved->grads[i];
    }
    for (const auto i : c10::irange(saved->buffers.size())) {
      auto& b = saved->buffers[i];
      const auto& value = saved->buffer_values[i];
      if (b.defined() && value.defined() && !b.equal(value)) {
        b.variable_data().copy_(value);
      }
    }
    for (const auto i : c10::irange(saved->modules.size())) {
      saved->modules[i]->train(saved->training[i]);
    }
  }

  torch::nn::AnyModule module_;
  std::unique_ptr<SavedState> saved_;
};

// Profiling draws random numbers (dropout, and Cloneable::clone() calls
// reset(), which initialises parameters afresh before copying the values):
// put the CPU generator back, so that balancing does not change what the
// program draws afterwards.
class CpuRngStateGuard {
 public:
  CpuRngStateGuard() : generator_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    state_ = generator_.get_state();
  }
  ~CpuRngStateGuard() {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(state_);
  }
  CpuRngStateGuard(const CpuRngStateGuard&) = delete;
  CpuRngStateGuard& operator=(const CpuRngStateGuard&) = delete;

 private:
  at::Generator generator_;
  torch::Tensor state_;
};

// Waits for the work queued on `device` (nothing to wait for on CPU).
void synchronize(const torch::Device& device) {
  if (device.is_cpu()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.getStream(device).synchronize();
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

void check_module(const torch::nn::Sequential& module) {
  TORCH_CHECK_VALUE(
      !module.is_empty(), "module must be a non-null torch::nn::Sequential");
  TORCH_CHECK_VALUE(
      module->size() > 0,
      "module has no layers to profile: expected a torch::nn::Sequential "
      "with at least one layer, but got an empty one");
}

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
      layers,
      " partitions for a module of ",
      layers,
      " layers, but got ",
      partitions);
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
  device = with_index(device);

  // Profiling trains: grad mode on, inference mode off, whatever the caller
  // has set.
  c10::InferenceMode no_inference(/*enabled=*/false);
  torch::AutoGradMode grad_mode(/*enabled=*/true);
  c10::OptionalDeviceGuard device_guard;
  if (!device.is_cpu()) {
    device_guard.reset_device(device);
  }
  CpuRngStateGuard rng;

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
      x = detached(x);
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
            "')");
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
  return passes > 1 ? rest : first;
}

// ---------------------------------------------------------------------------
// Counting CPU allocations.

// Note [Counting CPU allocations]
// balance_by_size measures what a layer's forward allocates and keeps alive
// (its output and the tensors its graph saves for backward), on CPU, where
// LibTorch has no memory statistics. While profiling, LibTorch's CPU
// allocator is replaced by a wrapper that forwards every allocation to it
// and, for allocations of a thread inside a CountingWindow, adds the bytes to
// the window and takes them off when they are freed, whenever and on
// whichever thread that happens. Only the profiling thread counts, so other
// threads of the program neither disturb the numbers nor pay more than a
// thread-local test.
//
// A counted allocation keeps its data pointer as context (as the default
// allocator's do), looked up in a registry when freed, so that the "raw"
// interface works: oneDNN allocates through raw_allocate/raw_deallocate of
// the CPU allocator. Memory raw-allocated while counting may be freed after
// the wrapper is gone, by the wrapped allocator's raw deleter; its record
// then stays behind until the address comes back, and is dropped then
// without freeing anything.
//
// c10::SetAllocator only replaces an allocator of lower or equal priority,
// and nothing reports the current priority: the wrapper goes in at the
// lowest priority that takes, which is the current one, and the previous
// allocator goes back at that same priority. The wrapper lives for the rest
// of the process: tensors allocated through it may outlive the profiling,
// and a storage resized later allocates through the allocator it was made
// with.

using LiveBytes = std::shared_ptr<std::atomic<int64_t>>;

thread_local LiveBytes* counting_window = nullptr;

class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& get() {
    static auto* allocator = new CountingCpuAllocator();
    return *allocator;
  }

  void set_base(c10::Allocator* base) {
    base_.store(base);
    base_raw_deleter_.store(base->raw_deleter());
  }

  // No `override` in this class: LibTorch before 2.3 declares allocate()
  // const and has no copy_data(), later versions declare allocate()
  // non-const and copy_data() pure. Both forms are defined, and each
  // overrides where the headers declare it (clang warns about `override` on
  // some members but not others).
  c10::DataPtr allocate(size_t n) const {
    return counted(n);
  }
  c10::DataPtr allocate(size_t n) {
    return counted(n);
  }
  void copy_data(void* dest, const void* src, size_t count) const {
    std::memcpy(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const {
    return base_raw_deleter_.load() != nullptr ? &release : nullptr;
  }

 private:
  struct Record {
    c10::DataPtr inner;
    size_t bytes = 0;
    LiveBytes live;
  };

  CountingCpuAllocator() = default;

  static std::mutex& registry_mutex() {
    static auto* mutex = new std::mutex();
    return *mutex;
  }
  // Counted allocations by data pointer. Guarded by registry_mutex().
  static std::unordered_map<void*, Record>& registry() {
    static auto* records = new std::unordered_map<void*, Record>();
    return *records;
  }

  c10::DataPtr counted(size_t n) const {
    c10::Allocator* base = base_.load();
    LiveBytes* window = counting_window;
    if (window == nullptr || n == 0) {
      return base->allocate(n);
    }
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    (*window)->fetch_add(static_cast<int64_t>(n));
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      auto& record = registry()[data];
      if (record.inner) {
        // A record left by memory freed behind our back (see Note
        // [Counting CPU allocations]): its memory is gone already.
        record.inner.release_context();
      }
      record = Record{std::move(inner), n, *window};
    }
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }

  static void release(void* data) {
    Record record;
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      auto it = registry().find(data);
      if (it != registry().end()) {
        record = std::move(it->second);
        registry().erase(it);
      }
    }
    if (!record.inner) {
      // Raw-allocated while not counting: the wrapped allocator's.
      if (auto deleter = base_raw_deleter_.load()) {
        deleter(data);
      }
      return;
    }
    record.live->fetch_sub(static_cast<int64_t>(record.bytes));
    // `record.inner` frees the memory as it goes.
  }

  inline static std::atomic<c10::Allocator*> base_{nullptr};
  inline static std::atomic<c10::DeleterFnPtr> base_raw_deleter_{nullptr};
};

// Installs the counting allocator for its lifetime; one at a time in the
// process.
class CountingAllocatorScope {
 public:
  CountingAllocatorScope() : lock_(mutex()) {
    auto* counting = &CountingCpuAllocator::get();
    previous_ = c10::GetAllocator(c10::DeviceType::CPU);
    TORCH_INTERNAL_ASSERT(previous_ != counting);
    counting->set_base(previous_);
    for (int priority = 0; priority <= 255; ++priority) {
      c10::SetAllocator(
          c10::DeviceType::CPU, counting, static_cast<uint8_t>(priority));
      if (c10::GetAllocator(c10::DeviceType::CPU) == counting) {
        priority_ = static_cast<uint8_t>(priority);
        return;
      }
    }
    TORCH_INTERNAL_ASSERT(false, "could not install the counting allocator");
  }
  ~CountingAllocatorScope() {
    c10::SetAllocator(c10::DeviceType::CPU, previous_, priority_);
  }
  CountingAllocatorScope(const CountingAllocatorScope&) = delete;
  CountingAllocatorScope& operator=(const CountingAllocatorScope&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex mutex;
    return mutex;
  }
  std::unique_lock<std::mutex> lock_;
  c10::Allocator* previous_ = nullptr;
  uint8_t priority_ = 0;
};

// Counts the bytes that this thread allocates during its lifetime and that
// are still alive.
class CountingWindow {
 public:
  CountingWindow()
      : live_(std::make_shared<std::atomic<int64_t>>(0)),
        previous_(counting_window) {
    counting_window = &live_;
  }
  ~CountingWindow() {
    counting_window = previous_;
  }
  CountingWindow(const CountingWindow&) = delete;
  CountingWindow& operator=(const CountingWindow&) = delete;

  int64_t bytes() const {
    return live_->load();
  }

 private:
  LiveBytes live_;
  LiveBytes* previous_;
};

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
      "param_scale must be a non-negative number, but got ",
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
  const int64_t rows = (batch + chunks - 1) / chunks;
  const double latent_scale = static_cast<double>(batch) /
                              static_cast<double>(chunks) /
                              static_cast<double>(rows);

  c10::InferenceMode no_inference(/*enabled=*/false);
  torch::AutoGradMode grad_mode(/*enabled=*/true);
  CpuRngStateGuard rng;

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
    x = detached(x);
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
          "')");
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

std::vector<std::vector<double>> solve_block_partition(
    const std::vector<double>& sequence, int64_t partitions) {
  const auto splits = block_partition_splits(sequence, partitions);
  TORCH_INTERNAL_ASSERT(!has_empty_block(splits), "empty block");
  std::vector<std::vector<double>> blocks;
  int64_t begin = 0;
  for (const auto end : splits) {
    blocks.emplace_back(sequence.begin() + begin, sequence.begin() + end);
    begin = end;
  }
  return blocks;
}

std::vector<int64_t> balance_cost(
    const std::vector<double>& costs, int64_t partitions) {
  auto splits = block_partition_splits(costs, partitions);
  std::vector<double> prefix(costs.size() + 1, 0.0);
  for (const auto i : c10::irange(costs.size())) {
    prefix[i + 1] = prefix[i] + costs[i];
  }
  // See Note [Block partition]: Bárány's blocks may be far from the best
  // (2.3 times the smallest possible largest block for [1, 3, 1, 1, 1, 1, 2,
  // 1, 1, 2] in 6 blocks), and never single out one dominant layer.
  const auto best = min_max_splits(prefix, partitions);
  const double ours = largest_block(prefix, splits);
  const double theirs = largest_block(prefix, best);
  if (has_empty_block(splits) ||
      ours - theirs > 1e-9 * std::max(std::abs(ours), std::abs(theirs))) {
    splits = best;
  }
  std::vector<int64_t> balance;
  int64_t begin = 0;
  for (const auto end : splits) {
    balance.push_back(end - begin);
    begin = end;
  }
  return balance;
}

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

std::vector<int64_t> balance_by_time(
    int64_t partitions,
    torch::nn::Sequential module,
    torch::Tensor sample,
    double timeout,
    torch::Device device) {
  check_partitions(partitions, module);
  return balance_cost(
      profile_times(module, std::move(sample), timeout, device), partitions);
}

std::vector<int64_t> balance_by_time(
    int64_t partitions,
    torch::nn::Sequential module,
    std::vector<torch::Tensor> sample,
    double timeout,
    torch::Device device) {
  check_partitions(partitions, module);
  return balance_cost(
      profile_times(module, std::move(sample), timeout, device), partitions);
}

std::vector<int64_t> balance_by_size(
    int64_t partitions,
    torch::nn::Sequential module,
    torch::Tensor input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  check_partitions(partitions, module);
  return balance_cost(
      profile_sizes(module, std::move(input), chunks, param_scale, device),
      partitions);
}

std::vector<int64_t> balance_by_size(
    int64_t partitions,
    torch::nn::Sequential module,
    std::vector<torch::Tensor> input,
    int64_t chunks,
    double param_scale,
    torch::Device device) {
  check_partitions(partitions, module);
  return balance_cost(
      profile_sizes(module, std::move(input), chunks, param_scale, device),
      partitions);
}

}  // namespace gpipe
