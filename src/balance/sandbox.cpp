#include "balance/sandbox.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/utils.h>

#include <exception>
#include <mutex>
#include <utility>

namespace gpipe::detail {

namespace {

torch::Tensor detach_keeping_requires_grad(const torch::Tensor& t) {
  return t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t;
}

}  // namespace

void check_module(const torch::nn::Sequential& module) {
  TORCH_CHECK_VALUE(
      !module.is_empty(), "module must be a non-null torch::nn::Sequential");
  TORCH_CHECK_VALUE(
      module->size() > 0,
      "module has no layers to profile: expected a torch::nn::Sequential "
      "with at least one layer, but got an empty one");
}

Packet layer_input(const Packet& a) {
  Packet out{{}, a.atomic};
  out.tensors.reserve(a.tensors.size());
  for (const auto& t : a.tensors) {
    if (!t.defined()) {
      out.tensors.push_back(t);
    } else if (t.requires_grad()) {
      out.tensors.push_back(t.detach().requires_grad_(true).clone());
    } else {
      out.tensors.push_back(t.detach().clone());
    }
  }
  return out;
}

Packet call_layer(
    torch::nn::AnyModule& layer, const Packet& input, size_t index) {
  return packet_of(
      input.atomic ? layer.any_forward(input.tensors.at(0))
                   : layer.any_forward(input.tensors),
      "layer",
      static_cast<int64_t>(index));
}

std::vector<torch::Tensor> ProfileSkipTracker::end_layer() {
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

void ProfileSkipTracker::stash(const SkipKey& key, torch::Tensor tensor) {
  auto copy = detach_keeping_requires_grad(tensor);
  entries_.insert_or_assign(
      key, Entry{layer_, std::move(tensor), std::move(copy)});
}

torch::Tensor ProfileSkipTracker::pop(const SkipKey& key) {
  auto it = entries_.find(key);
  TORCH_CHECK(it != entries_.end(), "'", key.name, "' has not been stashed");
  auto entry = std::move(it->second);
  entries_.erase(it);
  if (entry.layer == layer_) {
    return entry.attached;
  }
  return entry.detached;
}

Sandbox::Sandbox(const torch::nn::Sequential& module, torch::Device device)
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

// See Note [Profiling without touching the module].
ProfiledLayer::ProfiledLayer(Sandbox& sandbox, size_t k) {
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

ProfiledLayer::~ProfiledLayer() {
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

void ProfiledLayer::check_device(
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

void ProfiledLayer::save(torch::nn::Module& layer) {
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

void ProfiledLayer::restore() {
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

}  // namespace gpipe::detail
