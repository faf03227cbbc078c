#pragma once

// What a training checkpoint holds of a model and its optimizer, keyed so
// that any layout reads it: each layer by its global index (its place in
// the Sequential the pipeline was cut from), its parameters and buffers as
// `layers.<i>.<name>`, and the optimizer's state of each parameter as
// `optimizer.layers.<i>.<name>.<field>`. GPipe's save_checkpoint and
// load_checkpoint are here too; the distributed ones are
// src/dist/checkpoint.cpp's.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint_io.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace gpipe::detail {

/// A layer of the model at its global index.
struct IndexedLayer {
  int64_t index = 0;
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
};
using IndexedLayers = std::vector<IndexedLayer>;

/// The layers of `partition`, the first at global index `first`.
void add_layers(
    IndexedLayers& layers,
    const torch::nn::Sequential& partition,
    int64_t first);

/// Every defined parameter and buffer of `layers`, and (with an optimizer)
/// the optimizer's state of their parameters. A c10::ValueError when the
/// optimizer holds a parameter that is none of theirs.
NamedTensors tensors_of(
    const IndexedLayers& layers, const torch::optim::Optimizer* optimizer);

// Note [Each replica's buffers]
// Data-parallel replicas hold the same parameters and optimizer state
// (their gradients are averaged), which replica 0 writes, but buffers of
// their own: BatchNorm's running statistics follow each replica's shard.
// The ranks of replica d > 0 write their layers' buffers as
// `replicas.<d>.layers.<i>.<name>`, and a rank of replica d loads those
// when the checkpoint has them, replica 0's (`layers.<i>.<name>`) when it
// has not (a checkpoint of fewer replicas, or of one process). So a resume
// in the same layout gives every replica its own statistics back.

/// The defined buffers of `layers`, keyed for replica `replica` (see the
/// Note).
NamedTensors replica_buffers_of(const IndexedLayers& layers, int64_t replica);

/// The file of a checkpoint that holds the CPU generator's state
/// ("random.cpu"), apart from the layers so that every rank reads little.
constexpr const char* kRandomFile = "random.bin";

/// Throws c10::ValueError naming `what` unless `state` is a CPU
/// generator's state (a throwaway generator takes it).
void check_generator_state(const torch::Tensor& state, const char* what);

/// The checkpoint's TrainingState with its generator state, checked.
TrainingState read_state(CheckpointReader& reader);

/// Writes kRandomFile into `tmp`: `state`'s generator state (checked), or
/// the default CPU generator's now when it has none; adds it to `manifest`.
void write_random_file(
    const std::string& tmp,
    const TrainingState& state,
    nlohmann::json& manifest);

/// Checks `layers` (of a model of `total_layers`) and `optimizer` against
/// the checkpoint (the layers' names, every tensor's presence and shape,
/// the optimizer's kind and state) and returns what loading changes, to be
/// called once nothing can fail any more. A c10::ValueError names the first
/// difference. Buffers are replica `replica`'s where the checkpoint has
/// them (Note [Each replica's buffers]).
std::function<void()> plan_load(
    CheckpointReader& reader,
    const IndexedLayers& layers,
    int64_t total_layers,
    torch::optim::Optimizer* optimizer,
    int64_t replica = 0);

}  // namespace gpipe::detail
