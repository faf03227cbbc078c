#pragma once

// The optimizer's part of a training checkpoint: each parameter's state
// (SGD's momentum, Adam's and AdamW's moments and step, RMSprop's,
// Adagrad's) as `optimizer.layers.<i>.<name>.<field>`, keyed by its
// parameter's global layer index and name, so that any layout reads it.

#include <functional>
#include <string>

#include "checkpoint_state.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace gpipe::detail {

/// The name under which `optimizer`'s state is saved ("SGD", "Adam",
/// "AdamW", "RMSprop", "Adagrad"); a c10::ValueError for another kind.
std::string optimizer_kind(const torch::optim::Optimizer& optimizer);

/// The state of each of `optimizer`'s parameters that has one. A
/// c10::ValueError when it holds a parameter none of `layers` has.
NamedTensors optimizer_tensors(
    const IndexedLayers& layers, const torch::optim::Optimizer& optimizer);

/// Checks the checkpoint's optimizer state against `optimizer` (its kind,
/// each parameter's fields and shapes, what its options need) and returns
/// what putting it in place does, to be called once nothing can fail.
std::function<void()> plan_optimizer_load(
    CheckpointReader& reader,
    const IndexedLayers& layers,
    torch::optim::Optimizer& optimizer);

}  // namespace gpipe::detail
