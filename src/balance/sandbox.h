#pragma once

// Running the layers of a module one by one for profiling, each on a copy
// where it clones, and leaving the module, its gradients and the program's
// random numbers as they were. Shared by profile_times and profile_sizes.

#include <ATen/core/Generator.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "packet.h"
#include "random.h"
#include "skip.h"

namespace gpipe::detail {

/// Throws c10::ValueError unless `module` is non-null and has a layer.
void check_module(const torch::nn::Sequential& module);

/// A layer's input while profiling: a copy of each tensor of `a` (the
/// caller's sample, or the previous layer's output), cut from its graph.
/// A tensor that required grad is copied from a leaf that requires grad,
/// so the copy is not a leaf: an in-place layer (ReLU(inplace)) may work
/// on it, as it does inside a partition, and changes neither the caller's
/// sample nor what the next pass starts from.
Packet layer_input(const Packet& a);

/// Layer `index`'s output for `input`, as a Packet.
Packet call_layer(
    torch::nn::AnyModule& layer, const Packet& input, size_t index);

// Skips while profiling: each stash is kept detached (requiring grad as the
// stashed tensor did), so a later layer's pop starts a graph of its own and
// each layer's backward stays inside that layer, as each cell's does in the
// pipeline. While the stashing layer runs, the stashed tensor itself is kept
// too: a pop inside the same layer gets it, and otherwise it is a root of
// that layer's backward (the gradient the skip would bring back).
class ProfileSkipTracker final : public SkipTracker {
 public:
  void begin_layer(int64_t layer) {
    layer_ = layer;
  }

  // The stashed tensors of the current layer that a backward should start
  // from; forgets them, so that their graphs can go.
  std::vector<torch::Tensor> end_layer();

  void stash(const SkipKey& key, torch::Tensor tensor) override;
  torch::Tensor pop(const SkipKey& key) override;

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
  Sandbox(const torch::nn::Sequential& module, torch::Device device);

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
  ProfiledLayer(Sandbox& sandbox, size_t k);
  ~ProfiledLayer();
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
      const Sandbox& sandbox, size_t k, const torch::nn::Module& layer);
  void save(torch::nn::Module& layer);
  void restore();

  torch::nn::AnyModule module_;
  std::unique_ptr<SavedState> saved_;
};

// Profiling draws random numbers (dropout, and Cloneable::clone() calls
// reset(), which initialises parameters afresh before copying the values),
// so the profilers hold a CpuGeneratorAside (random.h) while they run: the
// numbers come from a stream of their own (on the CPU, a generator of the
// profiling thread's own, so the default generator, which pipelines on
// other threads watch, does not move), so balancing changes nothing the
// program draws later, and what other threads draw meanwhile is not handed
// out twice.

}  // namespace gpipe::detail
