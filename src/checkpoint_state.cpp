// A model's layers and its optimizer's state in a training checkpoint: see
// checkpoint_state.h.

#include "checkpoint_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/irange.h>
#include <gpipe/checkpoint_io.h>
#include <gpipe/module.h>
#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "checkpoint_optimizer.h"
#include "random.h"

namespace gpipe::detail {

void check_generator_state(const torch::Tensor& state, const char* what) {
  bool ok = state.defined() && state.scalar_type() == torch::kByte &&
            state.dim() == 1;
  if (ok) {
    // A throwaway generator takes it, or the default one would not.
    auto trial = at::make_generator<at::CPUGeneratorImpl>();
    try {
      trial.set_state(state.cpu());
    } catch (const c10::Error&) {
      ok = false;
    }
  }
  TORCH_CHECK_VALUE(
      ok,
      what,
      " is not a CPU generator's state (a byte tensor of the size "
      "torch's CPU generator's get_state() gives), but ",
      state.defined() ? state.toString() : std::string("undefined"),
      state.defined() ? " of shape " + c10::str(state.sizes()) : "");
}

TrainingState read_state(CheckpointReader& reader) {
  auto state = state_from_json(reader.manifest().at("state"));
  state.cpu_generator = reader.tensor("random.cpu").clone();
  check_generator_state(state.cpu_generator, "the checkpoint's random.cpu");
  return state;
}

void write_random_file(
    const std::string& tmp,
    const TrainingState& state,
    nlohmann::json& manifest) {
  auto generator = state.cpu_generator.defined() ? state.cpu_generator
                                                 : cpu_generator_state();
  check_generator_state(generator, "TrainingState::cpu_generator");
  detail::add_file(
      manifest,
      kRandomFile,
      write_tensor_file(tmp, kRandomFile, {{"random.cpu", generator}}));
}

void add_layers(
    IndexedLayers& layers,
    const torch::nn::Sequential& partition,
    int64_t first) {
  int64_t index = first;
  for (const auto& child : partition->named_children()) {
    layers.push_back(IndexedLayer{index++, child.key(), child.value()});
  }
}

NamedTensors tensors_of(
    const IndexedLayers& layers, const torch::optim::Optimizer* optimizer) {
  NamedTensors tensors;
  for (const auto& layer : layers) {
    const auto prefix = "layers." + std::to_string(layer.index) + ".";
    for (const auto& p : layer.module->named_parameters()) {
      if (p.value().defined()) {
        tensors.emplace_back(prefix + p.key(), p.value());
      }
    }
    for (const auto& b : layer.module->named_buffers()) {
      if (b.value().defined()) {
        tensors.emplace_back(prefix + b.key(), b.value());
      }
    }
  }
  if (optimizer == nullptr) {
    return tensors;
  }
  auto state = optimizer_tensors(layers, *optimizer);
  tensors.insert(tensors.end(), state.begin(), state.end());
  return tensors;
}

namespace {

std::string replica_prefix(int64_t replica) {
  return "replicas." + std::to_string(replica) + ".";
}

}  // namespace

NamedTensors replica_buffers_of(const IndexedLayers& layers, int64_t replica) {
  NamedTensors tensors;
  for (const auto& layer : layers) {
    const auto prefix =
        replica_prefix(replica) + "layers." + std::to_string(layer.index) + ".";
    for (const auto& b : layer.module->named_buffers()) {
      if (b.value().defined()) {
        tensors.emplace_back(prefix + b.key(), b.value());
      }
    }
  }
  return tensors;
}

std::function<void()> plan_load(
    CheckpointReader& reader,
    const IndexedLayers& layers,
    int64_t total_layers,
    torch::optim::Optimizer* optimizer,
    int64_t replica) {
  const auto& manifest = reader.manifest();
  const auto& where = reader.path();
  const auto names = manifest.at("layers").get<std::vector<std::string>>();
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(names.size()) == total_layers,
      "the checkpoint in '",
      where,
      "' has ",
      names.size(),
      " layers, but the model has ",
      total_layers);
  struct Copy {
    torch::Tensor into;
    torch::Tensor from;
  };
  std::vector<Copy> copies;
  for (const auto& layer : layers) {
    TORCH_CHECK_VALUE(
        names.at(layer.index) == layer.name,
        "layer ",
        layer.index,
        " is '",
        names.at(layer.index),
        "' in the checkpoint in '",
        where,
        "', but '",
        layer.name,
        "' in the model");
    const auto prefix = "layers." + std::to_string(layer.index) + ".";
    std::set<std::string> known;
    auto take = [&](const std::string& name,
                    const torch::Tensor& into,
                    bool buffer) {
      if (!into.defined()) {
        return;
      }
      auto key = prefix + name;
      known.insert(key);
      if (buffer && replica > 0 && reader.has(replica_prefix(replica) + key)) {
        key = replica_prefix(replica) + key;
      }
      TORCH_CHECK_VALUE(
          reader.has(key),
          "the checkpoint in '",
          where,
          "' has no tensor '",
          key,
          "', which the model has");
      auto from = reader.tensor(key);
      TORCH_CHECK_VALUE(
          from.sizes() == into.sizes(),
          "the checkpoint in '",
          where,
          "' has '",
          key,
          "' of shape ",
          from.sizes(),
          ", but the model's is ",
          into.sizes());
      copies.push_back(Copy{into, from});
    };
    for (const auto& p : layer.module->named_parameters()) {
      take(p.key(), p.value(), /*buffer=*/false);
    }
    for (const auto& b : layer.module->named_buffers()) {
      take(b.key(), b.value(), /*buffer=*/true);
    }
    for (const auto& key : reader.keys_with_prefix(prefix)) {
      TORCH_CHECK_VALUE(
          known.count(key) > 0,
          "the checkpoint in '",
          where,
          "' has '",
          key,
          "', which the model does not have");
    }
  }

  auto place_optimizer_state =
      optimizer != nullptr ? plan_optimizer_load(reader, layers, *optimizer)
                           : std::function<void()>([] {});
  return [copies = std::move(copies),
          place_optimizer_state = std::move(place_optimizer_state)]() {
    {
      torch::NoGradGuard no_grad;
      for (const auto& c : copies) {
        c.into.copy_(c.from);
      }
    }
    place_optimizer_state();
  };
}

}  // namespace gpipe::detail

namespace gpipe {

namespace {

detail::IndexedLayers layers_of(const GPipe& model) {
  detail::IndexedLayers layers;
  int64_t first = 0;
  for (const auto& child : model->partitions()->children()) {
    auto part = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child);
    TORCH_INTERNAL_ASSERT(part);
    detail::add_layers(layers, torch::nn::Sequential(part), first);
    first += static_cast<int64_t>(part->size());
  }
  return layers;
}

// The manifest file of checkpoint `path` as the file system knows it (its
// inode and change time), or zeros when it has none: a checkpoint written
// again in its place has another.
std::pair<uint64_t, int64_t> manifest_identity(const std::string& path) {
  struct stat status {};
  const auto manifest =
      (std::filesystem::path(path) / detail::kManifest).string();
  if (::stat(manifest.c_str(), &status) != 0) {
    return {0, 0};
  }
  return {
      static_cast<uint64_t>(status.st_ino),
      static_cast<int64_t>(status.st_ctim.tv_sec) * 1000000000 +
          status.st_ctim.tv_nsec};
}

// Reads the newest checkpoint in `dir` with `read`; when a writer took it
// away, or wrote that step again, while it was read (Note [Removing a
// checkpoint beside readers] in checkpoint_write.cpp), reads the newest
// again.
template <typename Read>
auto read_newest(const std::string& dir, const Read& read) {
  for (int attempt = 0;; ++attempt) {
    const auto path = latest_checkpoint(dir);
    const auto identity = manifest_identity(path);
    try {
      detail::CheckpointReader reader(path.empty() ? dir : path);
      return read(reader);
    } catch (const c10::Error&) {
      // (No manifest at the start: it went between the listing and then.)
      const bool went = identity == std::pair<uint64_t, int64_t>{0, 0};
      if (attempt < 8 && !path.empty() &&
          (went || manifest_identity(path) != identity)) {
        continue;
      }
      throw;
    }
  }
}

}  // namespace

void save_checkpoint(
    const std::string& dir,
    const GPipe& model,
    const torch::optim::Optimizer& optimizer,
    const TrainingState& state) {
  TORCH_CHECK_VALUE(
      !model.is_empty(), "save_checkpoint expects a non-null GPipe");
  const auto layers = layers_of(model);
  const auto tensors = detail::tensors_of(layers, &optimizer);
  nlohmann::json manifest;
  std::vector<std::string> names;
  for (const auto& layer : layers) {
    names.push_back(layer.name);
  }
  manifest["layers"] = names;
  manifest["layout"] = {
      {"writer", "gpipe::GPipe"},
      {"balance", model->balance()},
      {"stages_per_lane", model->stages_per_lane()},
      {"placement", model->placement().lane_of_stage()},
      {"chunks", model->options.chunks()},
      {"processes", 1},
      {"pipeline_size", 1},
      {"data_size", 1}};
  manifest["optimizer"] = detail::optimizer_kind(optimizer);
  manifest["state"] = detail::state_to_json(state);
  manifest["files"] = nlohmann::json::object();
  manifest["tensors"] = nlohmann::json::object();
  if (state.cpu_generator.defined()) {
    detail::check_generator_state(
        state.cpu_generator, "TrainingState::cpu_generator");
  }
  const auto tmp = detail::begin_checkpoint(dir, state.step);
  try {
    const std::string file = "rank-0.bin";
    detail::add_file(
        manifest, file, detail::write_tensor_file(tmp, file, tensors));
    detail::write_random_file(tmp, state, manifest);
  } catch (...) {
    // An unfinished checkpoint takes no room until the next save: it goes
    // now (the next save would remove it too).
    (void)detail::remove_tree(tmp);
    throw;
  }
  detail::commit_checkpoint(dir, tmp, state.step, std::move(manifest));
}

TrainingState load_checkpoint(
    const std::string& dir, GPipe& model, torch::optim::Optimizer& optimizer) {
  TORCH_CHECK_VALUE(
      !model.is_empty(), "load_checkpoint expects a non-null GPipe");
  const auto layers = layers_of(model);
  auto [apply, state] = read_newest(dir, [&](detail::CheckpointReader& reader) {
    auto apply = detail::plan_load(
        reader, layers, static_cast<int64_t>(layers.size()), &optimizer);
    return std::make_pair(std::move(apply), detail::read_state(reader));
  });
  apply();
  detail::set_cpu_generator_state(state.cpu_generator);
  return state;
}

TrainingState read_training_state(const std::string& dir) {
  return read_newest(dir, [](detail::CheckpointReader& reader) {
    return detail::read_state(reader);
  });
}

}  // namespace gpipe
