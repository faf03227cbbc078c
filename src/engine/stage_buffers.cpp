// The buffers of a checkpointed cell: what its recomputation reads of them.

#include <c10/util/irange.h>
#include <torch/autograd.h>

#include <algorithm>

#include "engine/stage.h"

namespace gpipe::detail {

// Note [Buffers a forward changes]
// A checkpointed cell runs its partition's forward again in backward, and
// its layers read their buffers then. A layer that reads a buffer and
// then updates it in its forward (a running average it normalises with,
// a power iteration's vector, a step counter) would be recomputed with
// the buffer as later forwards left it, and its gradients would be wrong
// without an error (torch.utils.checkpoint recomputes so too). So a
// checkpointed forward keeps the values of the buffers it may change, and
// the recomputation reads those; the buffers are put back as they were
// found once the backward is done (BufferRestore, so that a recomputation
// never updates running statistics twice).
//
// Keeping every buffer would cost a copy per micro-batch of buffers that
// never change (masks, positional tables) until its backward. A stage
// learns instead which buffers forwards change, from their version
// counters (bumped by every in-place LibTorch op, under NoGradGuard too):
// a buffer not seen yet is kept for the cell that first sees it, one seen
// changed is kept by every checkpointed forward after it, and one seen
// unchanged is kept no longer. Writes without a version bump (a kernel's
// own, as BatchNorm's running statistics, which its training forward does
// not read; writes through `.data()` or `data_ptr`) are not seen: such a
// buffer is recomputed as it is then, as before. A buffer that a forward
// first changes after others left it unchanged is kept from the next
// forward on; the recomputations of that cell and those before it read it
// as it is then.

void Stage::refresh_buffers(
    std::shared_ptr<const std::vector<torch::Tensor>> buffers) {
  std::lock_guard<std::mutex> lock(buffers_mutex_);
  // The same buffers as at the last pass (every pass but the first,
  // usually): nothing to redo.
  const auto same = [&] {
    if (!buffers_ || buffers_->size() != buffers->size()) {
      return false;
    }
    for (const auto k : c10::irange(buffers->size())) {
      if (!(*buffers_)[k].is_same((*buffers)[k])) {
        return false;
      }
    }
    return true;
  };
  if (same()) {
    return;
  }
  // Only the buffers of the list: none that is gone is kept alive by its
  // address (a new one at the same address would be taken for it).
  std::unordered_map<const c10::TensorImpl*, BufferSeen> seen;
  for (const auto& b : *buffers) {
    const auto found = buffers_seen_.find(b.unsafeGetTensorImpl());
    if (found != buffers_seen_.end()) {
      seen.insert(*found);
    }
  }
  buffers_seen_ = std::move(seen);
  buffers_ = std::move(buffers);
}

std::pair<
    std::shared_ptr<const std::vector<torch::Tensor>>,
    std::vector<int64_t>>
Stage::buffers_before_forward(CellState& c) {
  c.forward_buffers.clear();
  std::shared_ptr<const std::vector<torch::Tensor>> buffers;
  std::vector<bool> keep;
  {
    std::lock_guard<std::mutex> lock(buffers_mutex_);
    buffers = buffers_;
    if (!buffers || buffers->empty()) {
      return {};
    }
    keep.reserve(buffers->size());
    for (const auto& b : *buffers) {
      const auto found = buffers_seen_.find(b.unsafeGetTensorImpl());
      keep.push_back(
          found == buffers_seen_.end() || found->second == BufferSeen::Changed);
    }
  }
  std::vector<int64_t> versions(buffers->size(), -1);
  torch::NoGradGuard no_grad;
  for (const auto k : c10::irange(buffers->size())) {
    const auto& b = (*buffers)[k];
    // An inference tensor has no counter, and no forward outside
    // InferenceMode may change it.
    if (b.is_inference()) {
      continue;
    }
    versions[k] = static_cast<int64_t>(b._version());
    if (keep[k]) {
      c.forward_buffers.emplace_back(b, b.detach().clone());
    }
  }
  return {std::move(buffers), std::move(versions)};
}

void Stage::buffers_after_forward(
    CellState& c,
    const std::shared_ptr<const std::vector<torch::Tensor>>& buffers,
    const std::vector<int64_t>& versions) {
  if (!buffers) {
    return;
  }
  std::lock_guard<std::mutex> lock(buffers_mutex_);
  for (const auto k : c10::irange(buffers->size())) {
    const auto& b = (*buffers)[k];
    if (versions[k] < 0) {
      continue;
    }
    auto& seen = buffers_seen_[b.unsafeGetTensorImpl()];
    if (static_cast<int64_t>(b._version()) != versions[k]) {
      seen = BufferSeen::Changed;
    }
    // (A new entry is Unchanged.)
  }
  // Values of buffers no forward has changed are not needed.
  auto& kept = c.forward_buffers;
  kept.erase(
      std::remove_if(
          kept.begin(),
          kept.end(),
          [&](const std::pair<torch::Tensor, torch::Tensor>& entry) {
            const auto found =
                buffers_seen_.find(entry.first.unsafeGetTensorImpl());
            return found != buffers_seen_.end() &&
                   found->second == BufferSeen::Unchanged;
          }),
      kept.end());
}

void Stage::put_forward_buffers(const CellState& c) {
  if (c.forward_buffers.empty()) {
    return;
  }
  // Through variable_data(), as BufferRestore: no version bump.
  torch::NoGradGuard no_grad;
  for (const auto& [buffer, value] : c.forward_buffers) {
    buffer.variable_data().copy_(value);
  }
}

}  // namespace gpipe::detail
