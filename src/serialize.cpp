// Archives of GPipe and of the plain Sequential, read into either: see
// gpipe/serialize.h.

#include <c10/util/Exception.h>
#include <gpipe/checkpoint_io.h>
#include <gpipe/module.h>
#include <gpipe/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "checkpoint_state.h"

namespace gpipe {

namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;
using Layers =
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;

Layers layers_of(const torch::nn::Sequential& net) {
  Layers layers;
  for (const auto& child : net->named_children()) {
    layers.emplace_back(child.key(), child.value());
  }
  return layers;
}

Layers layers_of(const GPipe& model) {
  Layers layers;
  for (const auto& partition : *model->partitions()) {
    for (const auto& child : partition->named_children()) {
      layers.emplace_back(child.key(), child.value());
    }
  }
  return layers;
}

constexpr const char* kExpected =
    "expected an archive written by torch::save of a gpipe::GPipe or of a "
    "torch::nn::Sequential (or by gpipe::save_as_sequential), or a "
    "checkpoint directory written by gpipe::save_checkpoint";

// `path` read into `archive`; LibTorch's own errors name neither the file
// nor what it should have held.
void read_archive(InputArchive& archive, const std::string& path) {
  std::error_code error;
  TORCH_CHECK_VALUE(
      std::filesystem::is_regular_file(path, error),
      "cannot read '",
      path,
      "': ",
      std::filesystem::exists(path, error) ? "it is not a regular file"
                                           : "there is no such file",
      "; ",
      kExpected);
  TORCH_CHECK_VALUE(
      std::filesystem::file_size(path, error) > 0 && !error,
      "cannot read '",
      path,
      "': the file is empty; ",
      kExpected);
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    std::string reason = e.what_without_backtrace();
    reason = reason.substr(0, reason.find('\n'));
    TORCH_CHECK_VALUE(
        false,
        "cannot read '",
        path,
        "' (",
        reason,
        "): it is truncated or not such an archive; ",
        kExpected);
  }
}

// The archive of each layer, by layer name, from an archive of a GPipe
// (`partitions.<j>.<layer>`) or of a plain Sequential (`<layer>`).
std::map<std::string, InputArchive> archived_layers(
    const std::string& path, const Layers& layers) {
  InputArchive archive;
  read_archive(archive, path);
  std::set<std::string> names;
  for (const auto& layer : layers) {
    names.insert(layer.first);
  }
  std::map<std::string, InputArchive> found;
  InputArchive partitions;
  const bool of_gpipe = names.count("partitions") == 0 &&
                        archive.try_read("partitions", partitions);
  if (of_gpipe) {
    for (const auto& j : partitions.keys()) {
      InputArchive partition;
      partitions.read(j, partition);
      for (const auto& name : partition.keys()) {
        InputArchive layer;
        if (partition.try_read(name, layer)) {
          TORCH_CHECK_VALUE(
              found.count(name) == 0,
              "'",
              path,
              "' holds layer '",
              name,
              "' in two partitions: it is not an archive of one GPipe");
          found.emplace(name, std::move(layer));
        }
      }
    }
  } else {
    for (const auto& name : archive.keys()) {
      InputArchive layer;
      if (archive.try_read(name, layer)) {
        found.emplace(name, std::move(layer));
      }
    }
  }
  for (const auto& entry : found) {
    TORCH_CHECK_VALUE(
        names.count(entry.first) > 0,
        "'",
        path,
        "' has layer '",
        entry.first,
        "', which the model does not have: was it saved from another model?");
  }
  return found;
}

struct Copy {
  torch::Tensor into;
  torch::Tensor from;
};

// What loading `archive` into `module` copies, checked before anything is:
// every defined parameter and buffer present with its shape, every child
// present, nothing else in the archive.
void plan_copies(
    const torch::nn::Module& module,
    InputArchive& archive,
    const std::string& path,
    const std::string& prefix,
    std::vector<Copy>& copies) {
  std::set<std::string> known;
  auto take = [&](const std::string& name, const torch::Tensor& into) {
    known.insert(name);
    if (!into.defined()) {
      return;  // e.g. a Linear without bias
    }
    torch::Tensor from;
    TORCH_CHECK_VALUE(
        archive.try_read(name, from) && from.defined(),
        "'",
        path,
        "' has no tensor '",
        prefix + name,
        "', which the model has: was it saved from another model?");
    TORCH_CHECK_VALUE(
        from.sizes() == into.sizes(),
        "'",
        path,
        "' has '",
        prefix + name,
        "' of shape ",
        from.sizes(),
        ", but the model's is ",
        into.sizes());
    copies.push_back(Copy{into, from});
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    take(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    take(b.key(), b.value());
  }
  for (const auto& child : module.named_children()) {
    known.insert(child.key());
    if (!child.value()->is_serializable()) {
      continue;  // Module::save leaves it out (a Functional), load skips it
    }
    InputArchive sub;
    TORCH_CHECK_VALUE(
        archive.try_read(child.key(), sub),
        "'",
        path,
        "' has no module '",
        prefix + child.key(),
        "', which the model has: was it saved from another model?");
    plan_copies(*child.value(), sub, path, prefix + child.key() + ".", copies);
  }
  for (const auto& key : archive.keys()) {
    TORCH_CHECK_VALUE(
        known.count(key) > 0,
        "'",
        path,
        "' has '",
        prefix + key,
        "', which the model does not have: was it saved from another model?");
  }
}

void load_layers(const Layers& layers, const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    // A training checkpoint (gpipe/checkpoint_io.h): its layers by index.
    TORCH_CHECK_VALUE(
        !latest_checkpoint(path).empty(),
        "cannot read '",
        path,
        "': it is not a regular file, nor a directory holding a gpipe "
        "checkpoint; ",
        kExpected);
    detail::CheckpointReader reader(path);
    detail::IndexedLayers indexed;
    for (const auto& layer : layers) {
      indexed.push_back(detail::IndexedLayer{
          static_cast<int64_t>(indexed.size()), layer.first, layer.second});
    }
    detail::plan_load(
        reader, indexed, static_cast<int64_t>(indexed.size()), nullptr)();
    return;
  }
  auto archived = archived_layers(path, layers);
  std::vector<Copy> copies;
  for (const auto& layer : layers) {
    if (!layer.second->is_serializable()) {
      continue;  // as in plan_copies
    }
    auto it = archived.find(layer.first);
    TORCH_CHECK_VALUE(
        it != archived.end(),
        "'",
        path,
        "' has no layer '",
        layer.first,
        "', which the model has: was it saved from another model?");
    plan_copies(*layer.second, it->second, path, layer.first + ".", copies);
  }
  torch::NoGradGuard no_grad;
  for (auto& c : copies) {
    c.into.copy_(c.from);
  }
}

}  // namespace

void load_into_sequential(torch::nn::Sequential& net, const std::string& path) {
  TORCH_CHECK_VALUE(
      !net.is_empty(), "load_into_sequential expects a non-null Sequential");
  load_layers(layers_of(net), path);
}

void load_into_gpipe(GPipe& model, const std::string& path) {
  TORCH_CHECK_VALUE(
      !model.is_empty(), "load_into_gpipe expects a non-null GPipe");
  load_layers(layers_of(model), path);
}

void save_as_sequential(const GPipe& model, const std::string& path) {
  TORCH_CHECK_VALUE(
      !model.is_empty(), "save_as_sequential expects a non-null GPipe");
  OutputArchive archive;
  for (const auto& layer : layers_of(model)) {
    OutputArchive sub(archive.compilation_unit());
    layer.second->save(sub);
    archive.write(layer.first, sub);
  }
  archive.save_to(path);
}

}  // namespace gpipe
