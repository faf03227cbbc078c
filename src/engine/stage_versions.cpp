// Version counters of a checkpointed cell's inputs and of its partition's
// parameters: what a recomputation checks before it reads them again.

#include <c10/util/irange.h>

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
void Stage::note_parameters_left(
    const std::shared_ptr<const std::vector<torch::Tensor>>& parameters) {
  if (!parameters) {
    return;
  }
  std::lock_guard<std::mutex> lock(left_mutex_);
  left_parameters_ = parameters;
  left_versions_.resize(parameters->size());  // kept: no allocation a cell
  for (const auto k : c10::irange(parameters->size())) {
    const auto& p = (*parameters)[k];
    left_versions_[k] = p.is_inference() ? -1 : int64_t(p._version());
  }
  noted_.store(true, std::memory_order_relaxed);
}

std::shared_ptr<const std::vector<torch::Tensor>>
Stage::check_parameters_unchanged() {
  std::shared_ptr<const std::vector<torch::Tensor>> parameters;
  std::vector<int64_t> before;
  {
    std::lock_guard<std::mutex> lock(left_mutex_);
    parameters = left_parameters_;
    before = left_versions_;
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
