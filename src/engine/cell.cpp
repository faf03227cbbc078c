#include "engine/cell.h"

#include <c10/util/irange.h>
#include <gpipe/trace.h>

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

void record(
    const CellContext& ctx,
    TraceKind kind,
    CellClock::time_point start,
    CellClock::time_point end) {
  if (ctx.trace) {
    ctx.trace->record(ctx.lane, ctx.micro_batch, kind, start, end);
  }
}

}  // namespace gpipe::detail
