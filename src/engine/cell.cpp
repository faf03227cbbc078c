#include "engine/cell.h"

#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/trace.h>
#include <torch/nn/module.h>

namespace gpipe::detail {

namespace {

thread_local int cell_depth = 0;

}  // namespace

CellScope::CellScope(torch::Device device) {
  ++cell_depth;
  if (!device.is_cpu()) {
    device_guard_.reset_device(device);
  }
}

CellScope::~CellScope() {
  --cell_depth;
}

bool inside_cell() {
  return cell_depth > 0;
}

torch::Tensor leaf_of(const torch::Tensor& t, torch::Device device, bool grad) {
  if (!t.defined()) {
    return t;
  }
  // A tensor on the cell's device with no history is a leaf already: the
  // engine's own (a micro-batch's view, a received message), so its
  // autograd metadata is not the user's to keep.
  if (t.device() == device && !t.requires_grad()) {
    return t;
  }
  auto leaf = t.device() == device ? t.detach() : t.to(device).detach();
  if (grad && t.requires_grad() && is_differentiable(leaf)) {
    leaf.requires_grad_(true);
  }
  return leaf;
}

torch::Tensor sendable(const torch::Tensor& t, bool grad) {
  if (!t.defined()) {
    return t;
  }
  auto out = t.detach();
  if (grad && is_differentiable(out)) {
    out.requires_grad_(true);
  }
  return out;
}

bool& failed_in_recomputation() {
  thread_local bool failed = false;
  return failed;
}

BufferRestore::~BufferRestore() {
  try {
    restore();
  } catch (...) {
    // Already failing; the first error is the one reported.
  }
}

void BufferRestore::save(std::vector<torch::Tensor> buffers) {
  buffers_ = std::move(buffers);
  saved_.clear();
  for (const auto& b : buffers_) {
    saved_.push_back(b.clone());
  }
}

void BufferRestore::restore() {
  // Through variable_data(), which has its own version counter: a version
  // bump would fail the backward of a cell that saved these buffers and has
  // not run its backward yet (BatchNorm saves its running statistics; 1F1B
  // interleaves such cells with this one).
  torch::NoGradGuard no_grad;
  for (const auto k : c10::irange(buffers_.size())) {
    buffers_[k].variable_data().copy_(saved_[k]);
  }
  buffers_.clear();
  saved_.clear();
}

// Note [The modes of a recomputation]
// A checkpointed cell's backward runs its partition's forward again, and
// the layers read their train/eval mode then, not as it was: a model put in
// eval() between forward() and loss.backward() would recompute BatchNorm
// with its running statistics and Dropout without its mask, and back-
// propagate through a forward that never ran (the plain model's graph was
// recorded in the forward's modes). So a pass notes each module's mode when
// it begins (Stage::refresh), each checkpointed cell keeps that note, and
// its recomputation runs in those modes when they differ. Module::train
// sets a module's children too, so the modes are set in modules()'s order,
// each module before its children: each ends in its own. A
// DeferredBatchNorm's mode is the one it computes with (in_training(): the
// layer it replaced, which the user's Sequential holds), and its train()
// sets both. Likewise a parameter frozen when the pass began and unfrozen
// before its backward: the plain model's graph has no edge to it and it gets
// no gradient, so the recomputation runs with it frozen (it got one from
// each checkpointed micro-batch). The partition's modules are its lane's
// alone while the cell runs, and the caller waits in backward().
namespace {

bool mode_of(const ModeSnapshot& modes, size_t k) {
  const auto* deferred = modes.deferred[k];
  return deferred != nullptr ? deferred->in_training()
                             : modes.modules[k]->is_training();
}

void set_modes(const ModeSnapshot& modes, const std::vector<bool>& training) {
  for (const auto k : c10::irange(modes.modules.size())) {
    modes.modules[k]->train(training[k]);
  }
}

}  // namespace

ModeRestore::ModeRestore(const ModeSnapshot* forward) {
  if (forward == nullptr) {
    return;
  }
  // A parameter unfrozen since the forward: the plain model's graph has no
  // path to it, so it gets no gradient from this cell.
  unfrozen_.reserve(forward->frozen.size());
  for (const auto& p : forward->frozen) {
    if (p.requires_grad()) {
      unfrozen_.push_back(p);  // reserved: cannot throw
      p.requires_grad_(false);
    }
  }
  // Anything below that throws (an allocation, a layer's own train())
  // leaves the parameters and modes as found.
  try {
    bool same = true;
    found_.reserve(forward->modules.size());
    for (const auto k : c10::irange(forward->modules.size())) {
      found_.push_back(mode_of(*forward, k));
      same = same && found_.back() == forward->training[k];
    }
    if (same) {
      found_.clear();
      return;
    }
    // A DeferredBatchNorm's own flag too, which train() sets to the mode it
    // computes in (it may have been another: net->eval() leaves it).
    own_found_.reserve(forward->modules.size());
    for (const auto k : c10::irange(forward->modules.size())) {
      own_found_.push_back(forward->modules[k]->is_training());
    }
    forward_ = forward;
    set_modes(*forward, forward->training);
  } catch (...) {
    put_back();
    throw;
  }
}

void ModeRestore::put_back() {
  for (auto& p : unfrozen_) {
    p.requires_grad_(true);
  }
  unfrozen_.clear();
  if (forward_ == nullptr) {
    return;
  }
  const auto* forward = forward_;
  forward_ = nullptr;
  set_modes(*forward, found_);
  for (const auto k : c10::irange(forward->modules.size())) {
    if (forward->deferred[k] != nullptr) {
      forward->deferred[k]->torch::nn::Module::train(own_found_[k]);
    }
  }
}

ModeRestore::~ModeRestore() {
  try {
    put_back();
  } catch (...) {
    // A layer's own train() that throws did so above as well.
  }
}

void record(
    const CellContext& ctx,
    int64_t stage,
    TraceKind kind,
    CellClock::time_point start,
    CellClock::time_point end) {
  if (ctx.trace) {
    ctx.trace->record(
        ctx.lane, ctx.micro_batch, kind, start, end, /*failed=*/false, stage);
  }
}

}  // namespace gpipe::detail
