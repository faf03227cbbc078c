// Training checkpoints of a PipelineStage: every rank calls, the first
// replica's pipeline ranks write their partitions, the other replicas'
// ranks their buffers, rank 0 the manifest.
// The format is the one-process one (src/checkpoint_io.h), so that any
// layout reads any other's.

#include <c10/util/irange.h>
#include <gpipe/dist.h>
#include <torch/optim/optimizer.h>

#include <exception>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "checkpoint_io.h"
#include "checkpoint_optimizer.h"
#include "checkpoint_state.h"
#include "dist/agreement.h"
#include "dist/checkpoint_calls.h"
#include "dist/connection.h"
#include "random.h"

namespace gpipe::dist {

namespace {

using detail::agree_on_call;
using detail::agree_on_outcome;
using detail::call_prefix;
using detail::check_result;
using detail::ForgetCallKeys;
using detail::read_within_timeout;
using detail::result_failed;
using detail::result_is_ok;
using detail::result_kind;
using detail::result_ok;
using detail::result_value;
using detail::store_bytes;
using detail::store_text;

// The optimizer's kind for agree_on_call; one a checkpoint cannot hold is
// refused by the writers (or readers) afterwards, on every rank alike.
std::string optimizer_kind_of(const torch::optim::Optimizer& optimizer) {
  try {
    return gpipe::detail::optimizer_kind(optimizer);
  } catch (const c10::Error&) {
    return "of another kind";
  }
}

// This rank's layers by global index: stage.partitions()[k] is partition
// stage.partition_indices()[k].
gpipe::detail::IndexedLayers layers_of(const PipelineStage& stage) {
  const auto& balance = stage->balance();
  std::vector<int64_t> first(balance.size() + 1, 0);
  for (const auto j : c10::irange(balance.size())) {
    first[j + 1] = first[j] + balance[j];
  }
  gpipe::detail::IndexedLayers layers;
  const auto indices = stage->partition_indices();
  for (const auto k : c10::irange(indices.size())) {
    gpipe::detail::add_layers(
        layers, stage->partitions()[k], first.at(indices[k]));
  }
  return layers;
}

int64_t total_layers(const PipelineStage& stage) {
  int64_t total = 0;
  for (auto b : stage->balance()) {
    total += b;
  }
  return total;
}

void save_on_ranks(
    const std::string& dir,
    const PipelineStage& stage,
    const torch::optim::Optimizer& optimizer,
    const TrainingState& state) {
  const auto& mesh = stage->mesh();
  const auto& world = mesh.world();
  auto& store = *world.store();
  const auto prefix = call_prefix(world);
  const ForgetCallKeys forget(world, prefix);
  agree_on_call(
      world,
      prefix,
      "save_checkpoint",
      c10::str(
          "save_checkpoint(step ",
          state.step,
          ", optimizer ",
          optimizer_kind_of(optimizer),
          ")"));
  const auto pipeline_rank = mesh.pipeline_rank();
  const bool writer = mesh.data_rank() == 0;
  // This rank's own error, rethrown with its type once every rank knows.
  std::exception_ptr own;
  auto fail_here = [&own]() {
    own = std::current_exception();
    return result_failed(own);
  };

  // Rank 0 makes the temporary directory every writer writes into.
  if (world.rank() == 0) {
    std::string begun;
    try {
      (void)gpipe::detail::state_to_json(state);  // text it can write
      begun = result_ok(gpipe::detail::begin_checkpoint(dir, state.step));
    } catch (...) {
      begun = fail_here();
    }
    store.set(prefix + "tmp", store_bytes(begun));
  }
  const auto begun =
      read_within_timeout(world, prefix, prefix + "tmp", 0, "save_checkpoint");
  const auto tmp = result_value(begun);

  // Each pipeline rank of the first replica writes its partitions' file and
  // tells rank 0 what is in it.
  if (writer && result_is_ok(begun)) {
    std::string part;
    try {
      const auto layers = layers_of(stage);
      const auto tensors = gpipe::detail::tensors_of(layers, &optimizer);
      const auto file = "rank-" + std::to_string(pipeline_rank) + ".bin";
      nlohmann::json names = nlohmann::json::object();
      for (const auto& layer : layers) {
        names[std::to_string(layer.index)] = layer.name;
      }
      part = result_ok(nlohmann::json{
          {"file", file},
          {"written", gpipe::detail::write_tensor_file(tmp, file, tensors)},
          {"layers", names},
          {"optimizer", gpipe::detail::optimizer_kind(optimizer)}}
                           .dump());
    } catch (...) {
      part = fail_here();
    }
    store.set(
        prefix + "part" + std::to_string(pipeline_rank), store_bytes(part));
  }

  // The other replicas' ranks write their layers' buffers (BatchNorm's
  // running statistics are per replica, Note [Each replica's buffers] in
  // checkpoint_state.h), when they have any, and tell rank 0.
  if (!writer && result_is_ok(begun)) {
    std::string part = result_ok("");
    try {
      const auto buffers =
          gpipe::detail::replica_buffers_of(layers_of(stage), mesh.data_rank());
      if (!buffers.empty()) {
        const auto file = "replica-" + std::to_string(mesh.data_rank()) +
                          "-rank-" + std::to_string(pipeline_rank) + ".bin";
        part = result_ok(nlohmann::json{
            {"file", file},
            {"written", gpipe::detail::write_tensor_file(tmp, file, buffers)}}
                             .dump());
      }
    } catch (...) {
      part = fail_here();
    }
    store.set(
        prefix + "buffers" + std::to_string(world.rank()), store_bytes(part));
  }

  // Rank 0 writes the manifest once every file is on disk.
  if (world.rank() == 0) {
    std::string done = result_ok("");
    if (!result_is_ok(begun)) {
      done = result_failed(
          "rank 0 could not begin it: " + tmp, result_kind(begun));
    } else {
      try {
        nlohmann::json manifest;
        std::vector<std::string> names(total_layers(stage));
        manifest["files"] = nlohmann::json::object();
        manifest["tensors"] = nlohmann::json::object();
        // What a rank reported under `key`, once it has; its failure,
        // after `failed` ("rank 3 could not write ...").
        auto reported = [&](const std::string& key,
                            int64_t from,
                            const std::string& failed) {
          const auto result = read_within_timeout(
              world, prefix, prefix + key, from, "save_checkpoint");
          check_result(result, failed);
          return result_value(result);
        };
        for (const auto r : c10::irange(mesh.pipeline_size())) {
          const auto part = nlohmann::json::parse(reported(
              "part" + std::to_string(r),
              r,
              c10::str(
                  world.connection()->rank_name(r),
                  " (pipeline rank ",
                  r,
                  " of the first replica) could not write its partitions")));
          for (const auto& item : part.at("layers").items()) {
            names.at(std::stoll(item.key())) = item.value().get<std::string>();
          }
          manifest["optimizer"] = part.at("optimizer");
          gpipe::detail::add_file(
              manifest, part.at("file").get<std::string>(), part.at("written"));
        }
        for (const auto r : c10::irange(mesh.pipeline_size(), world.size())) {
          const auto written = reported(
              "buffers" + std::to_string(r),
              r,
              c10::str("rank ", r, " could not write its replica's buffers"));
          if (!written.empty()) {
            const auto part = nlohmann::json::parse(written);
            gpipe::detail::add_file(
                manifest,
                part.at("file").get<std::string>(),
                part.at("written"));
          }
        }
        manifest["layers"] = names;
        manifest["layout"] = {
            {"writer", "gpipe::dist::PipelineStage"},
            {"balance", stage->balance()},
            {"stages_per_lane", stage->stages_per_lane()},
            {"placement", stage->placement().lane_of_stage()},
            {"chunks", stage->chunks()},
            {"processes", world.size()},
            {"pipeline_size", mesh.pipeline_size()},
            {"data_size", mesh.data_size()}};
        manifest["state"] = gpipe::detail::state_to_json(state);
        gpipe::detail::write_random_file(tmp, state, manifest);
        gpipe::detail::commit_checkpoint(
            dir, tmp, state.step, std::move(manifest));
      } catch (...) {
        done = own ? result_failed(std::current_exception()) : fail_here();
      }
    }
    if (!result_is_ok(done) && result_is_ok(begun)) {
      // An unfinished checkpoint takes no room until the next save (every
      // writer has reported, so none writes into it any more; one renamed
      // into place is not there).
      (void)gpipe::detail::remove_tree(tmp);
    }
    store.set(prefix + "done", store_bytes(done));
  }
  const auto done =
      read_within_timeout(world, prefix, prefix + "done", 0, "save_checkpoint");
  if (!result_is_ok(done) && own) {
    std::rethrow_exception(own);
  }
  check_result(done, "gpipe::dist::save_checkpoint failed");
}

TrainingState load_on_ranks(
    const std::string& dir,
    PipelineStage& stage,
    torch::optim::Optimizer& optimizer) {
  const auto& world = stage->mesh().world();
  auto& store = *world.store();
  const auto prefix = call_prefix(world);
  const ForgetCallKeys forget(world, prefix);
  agree_on_call(
      world,
      prefix,
      "load_checkpoint",
      c10::str(
          "load_checkpoint(optimizer ", optimizer_kind_of(optimizer), ")"));
  // Rank 0 says which checkpoint: a save may not be seen alike by all.
  if (world.rank() == 0) {
    std::string chosen;
    try {
      const auto newest = latest_checkpoint(dir);
      chosen = result_ok(newest.empty() ? dir : newest);
    } catch (...) {
      chosen = result_failed(std::current_exception());
    }
    store.set(prefix + "path", store_bytes(chosen));
  }
  const auto chosen =
      read_within_timeout(world, prefix, prefix + "path", 0, "load_checkpoint");
  const auto path = result_value(chosen);

  TrainingState state;
  std::function<void()> apply;
  std::exception_ptr error;
  try {
    TORCH_CHECK_VALUE(result_is_ok(chosen), path);
    gpipe::detail::CheckpointReader reader(path);
    apply = gpipe::detail::plan_load(
        reader,
        layers_of(stage),
        total_layers(stage),
        &optimizer,
        stage->mesh().data_rank());
    state = gpipe::detail::read_state(reader);
  } catch (...) {
    error = std::current_exception();
  }
  std::exception_ptr agreed;
  try {
    agree_on_outcome(
        world,
        prefix,
        "load_checkpoint",
        error ? detail::message_of(error) : std::string());
  } catch (...) {
    agreed = std::current_exception();
  }
  if (error) {
    std::rethrow_exception(error);  // this rank's own, with its type
  }
  if (agreed) {
    std::rethrow_exception(agreed);
  }
  apply();
  gpipe::detail::set_cpu_generator_state(state.cpu_generator);
  return state;
}

}  // namespace

void save_checkpoint(
    const std::string& dir,
    const PipelineStage& stage,
    const torch::optim::Optimizer& optimizer,
    const TrainingState& state) {
  TORCH_CHECK_VALUE(
      !stage.is_empty(),
      "gpipe::dist::save_checkpoint expects a non-null PipelineStage");
  detail::with_c10_errors(stage->mesh().world(), "save_checkpoint", [&] {
    save_on_ranks(dir, stage, optimizer, state);
  });
}

TrainingState load_checkpoint(
    const std::string& dir,
    PipelineStage& stage,
    torch::optim::Optimizer& optimizer) {
  TORCH_CHECK_VALUE(
      !stage.is_empty(),
      "gpipe::dist::load_checkpoint expects a non-null PipelineStage");
  TrainingState state;
  detail::with_c10_errors(stage->mesh().world(), "load_checkpoint", [&] {
    state = load_on_ranks(dir, stage, optimizer);
  });
  return state;
}

}  // namespace gpipe::dist
