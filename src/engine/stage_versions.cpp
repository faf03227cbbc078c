// Version counters of a checkpointed cell's inputs and of its partition's
// parameters: what a recomputation checks before it reads them again.

#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/stage.h"

namespace gpipe::detail {

// Note [In-place changes to a checkpointed input]
// A checkpointed cell keeps only its input and runs its forward again in
// backward. A layer that changes that input in place (x.mul_(2), an
// in-place ReLU first in a partition) changed what the recomputation
// reads: it would run on the changed input, and apply the change again,
// and the gradients would be wrong without an error. (Micro-batches of
// the first stage are views of the user's batch, so an in-place change
// there also changes the user's tensor, as the plain model's does.) The
// input's version counter says whether anything wrote into it: it is
// taken before the forward and compared before the recomputation, which
// refuses a changed input. Views share their base's counter, so a change
// to another micro-batch of the same batch counts too: the recomputation
// would read storage that was written to. The same holds for the
// partition's parameters (frozen ones too: they shape the gradient of the
// input): one changed in place between the forward and the backward (an
// optimizer's step, a load, under NoGradGuard) would be read by the
// recomputation as it is now, where the plain model's backward refuses the
// change of a tensor it saved. Their counters are taken as the layers
// leave them, after each forward and recomputation of a pass that
// checkpoints (a layer may change its own weights as it runs: an
// Embedding with max_norm renormalises them in place in every forward),
// and compared before each recomputation: a change since the layers last
// ran came from outside.

// Note [Parameters written through .data()]
// LibTorch's SGD (torch::optim::SGD, in 1.13 and 2.x) writes its step into
// p.data(), a tensor whose version counter is not the parameter's: an
// optimizer.step() between the forward and the backward left every counter
// as it was, and the checkpointed cells recomputed with the new weights
// (gradients 0.2 off the plain model's in a small MLP) without a word. So
// the note also keeps a few values of each parameter on the CPU (kSampled,
// evenly spaced: a step moves every weight that has a gradient), read in
// place, and the check compares them bit for bit. A step that moved none of
// them (weights without a gradient: the rows of an Embedding that no
// sample used) goes unseen, as does any such step on other devices, where
// reading them would wait for the device: there the counters alone are
// checked.

namespace {

constexpr int64_t kSampled = 8;

// Appends the bytes of up to kSampled evenly spaced values of `p`, where
// they can be read in place (a dense CPU tensor: its numel() values lie
// from data_ptr() on, in some order, channels_last too).
void append_samples(const torch::Tensor& p, std::vector<uint8_t>& out) {
  if (!p.defined() || !p.is_cpu() || p.layout() != c10::kStrided ||
      p.is_quantized() || !p.has_storage() ||
      !p.is_non_overlapping_and_dense() || p.numel() == 0) {
    return;
  }
  const auto n = p.numel();
  const auto count = std::min(n, kSampled);
  const auto size = static_cast<int64_t>(p.element_size());
  const auto* base = static_cast<const uint8_t*>(p.data_ptr());
  for (const auto k : c10::irange(count)) {
    const auto at = count == 1 ? 0 : k * (n - 1) / (count - 1);
    out.insert(out.end(), base + at * size, base + (at + 1) * size);
  }
}

}  // namespace

void Stage::note_parameters_left(
    const std::shared_ptr<const std::vector<torch::Tensor>>& parameters) {
  if (!parameters) {
    return;
  }
  std::lock_guard<std::mutex> lock(left_mutex_);
  left_parameters_ = parameters;
  // Kept: no allocation a cell.
  left_versions_.resize(parameters->size());
  left_samples_.clear();
  left_sample_ends_.clear();
  for (const auto k : c10::irange(parameters->size())) {
    const auto& p = (*parameters)[k];
    left_versions_[k] = p.is_inference() ? -1 : int64_t(p._version());
    append_samples(p, left_samples_);
    left_sample_ends_.push_back(left_samples_.size());
  }
  noted_.store(true, std::memory_order_relaxed);
}

std::shared_ptr<const std::vector<torch::Tensor>>
Stage::check_parameters_unchanged() {
  std::shared_ptr<const std::vector<torch::Tensor>> parameters;
  std::vector<int64_t> before;
  std::vector<uint8_t> samples;
  std::vector<size_t> ends;
  {
    std::lock_guard<std::mutex> lock(left_mutex_);
    parameters = left_parameters_;
    before = left_versions_;
    samples = left_samples_;
    ends = left_sample_ends_;
  }
  if (!parameters) {
    return parameters;
  }
  const auto now = versions_of({}, *parameters);
  for (const auto k : c10::irange(now.size())) {
    TORCH_CHECK_VALUE(
        now[k] == before[k],
        "a parameter of a checkpointed partition (",
        name_of_parameter((*parameters)[k]),
        ") was changed in place after the partition's forward (its version "
        "went from ",
        before[k],
        " to ",
        now[k],
        "): the backward recomputes the forward with the parameters as they "
        "are now, so the gradients would be wrong. Change parameters after "
        "the backward (optimizer.step() after loss.backward()), or do not "
        "checkpoint (Checkpoint::Never)");
  }
  std::vector<uint8_t> now_samples;
  for (const auto k : c10::irange(parameters->size())) {
    const auto& p = (*parameters)[k];
    now_samples.clear();
    append_samples(p, now_samples);
    const size_t begin = k == 0 ? 0 : ends.at(k - 1);
    TORCH_CHECK_VALUE(
        now_samples.size() == ends.at(k) - begin &&
            std::equal(
                now_samples.begin(),
                now_samples.end(),
                samples.begin() + static_cast<std::ptrdiff_t>(begin)),
        "a parameter of a checkpointed partition (",
        name_of_parameter(p),
        ") was changed after the partition's forward (its values changed, "
        "its version did not: written through .data(), as "
        "torch::optim::SGD's step writes): the backward recomputes the "
        "forward with the parameters as they are now, so the gradients "
        "would be wrong. Step the optimizer after the backward "
        "(optimizer.step() after loss.backward()), or do not checkpoint "
        "(Checkpoint::Never)");
  }
  return parameters;
}

std::string Stage::name_of_parameter(const torch::Tensor& p) const {
  for (const auto& item : module_->named_parameters()) {
    if (item.value().is_same(p)) {
      return c10::str("'", item.key(), "', of shape ", p.sizes());
    }
  }
  return c10::str("of shape ", p.sizes());
}

std::vector<int64_t> Stage::versions_of(
    const std::vector<torch::Tensor>& skips,
    const std::vector<torch::Tensor>& inputs) {
  std::vector<int64_t> versions;
  versions.reserve(skips.size() + inputs.size());
  for (const auto* list : {&skips, &inputs}) {
    for (const auto& t : *list) {
      versions.push_back(
          t.defined() && !t.is_inference() ? int64_t(t._version()) : -1);
    }
  }
  return versions;
}

}  // namespace gpipe::detail
