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
#include "dist/connection.h"
#include "random.h"

namespace gpipe::dist {

namespace {

// The store's bytes as a string, and back.
std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}
std::string string_of(const std::vector<uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

// Results travel through the store as "ok:<value>" or "error:<message>".
std::string ok(const std::string& value) {
  return "ok:" + value;
}
std::string failed(const std::string& message) {
  return "error:" + message;
}
bool is_ok(const std::string& result) {
  return result.rfind("ok:", 0) == 0;
}
std::string value_of(const std::string& result) {
  return result.substr(result.find(':') + 1);
}

// Note [Checkpoint calls within the timeout]
// Every rank of the World calls save_checkpoint or load_checkpoint at once,
// and they talk through the World's store. A wait for another rank's word
// is bounded by the World's timeout (a HashStore waits 300 s by default,
// whatever the World's is) and names the rank waited for. Before anything
// else the ranks say which call they make, and with what (a save's step and
// optimizer kind): a rank that calls load while another saves, or saves
// with another optimizer (which would write a manifest that names one kind
// over another's state, loadable by neither), fails every rank at once
// with a c10::ValueError naming both sides, and nothing is written.

// The value of `key`, which `from` sets, once it is there.
std::string read(
    const World& world,
    const std::string& key,
    int64_t from,
    const char* what) {
  auto& store = *world.store();
  const auto& connection = *world.connection();
  try {
    store.wait({key}, connection.timeout);
  } catch (const std::exception&) {
    TORCH_CHECK(
        false,
        "gpipe::dist::",
        what,
        ": ",
        connection.rank_name(world.rank()),
        " waited ",
        connection.timeout.count() / 1000.0,
        " s for ",
        connection.rank_name(from),
        ", which had not reached it (every rank calls ",
        what,
        " together, between steps)");
  }
  return string_of(store.get(key));
}

// The optimizer's kind for agree_on_call; one a checkpoint cannot hold is
// refused by the writers (or readers) afterwards, on every rank alike.
std::string kind_of(const torch::optim::Optimizer& optimizer) {
  try {
    return gpipe::detail::optimizer_kind(optimizer);
  } catch (const c10::Error&) {
    return "of another kind";
  }
}

// Every rank says which call it makes (`call`: its name and arguments, as
// "what step=5 optimizer=Adam"); each returns when all have said, or
// throws on every rank the first that differs from rank 0's.
void agree_on_call(
    const World& world,
    const std::string& prefix,
    const char* what,
    const std::string& call) {
  world.store()->set(
      prefix + "call" + std::to_string(world.rank()), bytes_of(call));
  const auto first = read(world, prefix + "call0", 0, what);
  for (const auto r : c10::irange(int64_t{1}, world.size())) {
    const auto theirs =
        read(world, prefix + "call" + std::to_string(r), r, what);
    const auto& connection = *world.connection();
    TORCH_CHECK_VALUE(
        theirs == first,
        "gpipe::dist::",
        what,
        ": ",
        connection.rank_name(r),
        " called ",
        theirs,
        " but ",
        connection.rank_name(0),
        " called ",
        first,
        "; every rank calls the same checkpoint function at once, with the "
        "same step and the same kind of optimizer. Nothing was written or "
        "loaded");
  }
}

// Every rank says how it fared (`error` empty when it did); each returns
// when all have said, throwing the first failing rank's error on every
// rank.
void agree(
    const World& world,
    const std::string& prefix,
    const std::string& what,
    const std::string& error) {
  auto& store = *world.store();
  store.set(
      prefix + "rank" + std::to_string(world.rank()),
      bytes_of(error.empty() ? ok("") : failed(error)));
  for (const auto r : c10::irange(world.size())) {
    const auto result =
        read(world, prefix + "rank" + std::to_string(r), r, "load_checkpoint");
    TORCH_CHECK_VALUE(
        is_ok(result),
        "gpipe::dist::",
        what,
        ": rank ",
        r,
        " failed: ",
        value_of(result));
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

// Once every rank is past a collective's keys (`keys` under `prefix`), the
// last one to get here removes them from the store, so that a long run's
// checkpoints do not pile up there.
void forget(
    const World& world,
    const std::string& prefix,
    std::vector<std::string> keys) {
  auto& store = *world.store();
  if (store.add(prefix + "past", 1) == world.size()) {
    keys.push_back("past");
    for (const auto& key : keys) {
      store.deleteKey(prefix + key);
    }
  }
}

// A prefix of store keys that no other collective of this World uses
// (the same for a save and a load, so that ranks that call one each meet).
std::string unique_prefix(const World& world) {
  return "checkpoint/" + std::to_string(world.connection()->next_stage_id()) +
         "/";
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
  const auto& mesh = stage->mesh();
  const auto& world = mesh.world();
  auto& store = *world.store();
  const auto prefix = unique_prefix(world);
  std::exception_ptr disagreed;
  try {
    agree_on_call(
        world,
        prefix,
        "save_checkpoint",
        c10::str(
            "save_checkpoint(step ",
            state.step,
            ", optimizer ",
            kind_of(optimizer),
            ")"));
  } catch (...) {
    disagreed = std::current_exception();
  }
  if (disagreed) {
    std::vector<std::string> keys;
    for (const auto r : c10::irange(world.size())) {
      keys.push_back("call" + std::to_string(r));
    }
    forget(world, prefix, keys);
    std::rethrow_exception(disagreed);
  }
  const auto pipeline_rank = mesh.pipeline_rank();
  const bool writer = mesh.data_rank() == 0;
  // This rank's own error, rethrown with its type once every rank knows.
  std::exception_ptr own;
  auto fail_here = [&own]() {
    own = std::current_exception();
    return failed(detail::message_of(own));
  };

  // Rank 0 makes the temporary directory every writer writes into.
  if (world.rank() == 0) {
    std::string begun;
    try {
      (void)gpipe::detail::state_to_json(state);  // text it can write
      begun = ok(gpipe::detail::begin_checkpoint(dir, state.step));
    } catch (...) {
      begun = fail_here();
    }
    store.set(prefix + "tmp", bytes_of(begun));
  }
  const auto begun = read(world, prefix + "tmp", 0, "save_checkpoint");
  const auto tmp = value_of(begun);

  // Each pipeline rank of the first replica writes its partitions' file and
  // tells rank 0 what is in it.
  if (writer && is_ok(begun)) {
    std::string part;
    try {
      const auto layers = layers_of(stage);
      const auto tensors = gpipe::detail::tensors_of(layers, &optimizer);
      const auto file = "rank-" + std::to_string(pipeline_rank) + ".bin";
      nlohmann::json names = nlohmann::json::object();
      for (const auto& layer : layers) {
        names[std::to_string(layer.index)] = layer.name;
      }
      part = ok(nlohmann::json{
          {"file", file},
          {"written", gpipe::detail::write_tensor_file(tmp, file, tensors)},
          {"layers", names},
          {"optimizer", gpipe::detail::optimizer_kind(optimizer)}}
                    .dump());
    } catch (...) {
      part = fail_here();
    }
    store.set(prefix + "part" + std::to_string(pipeline_rank), bytes_of(part));
  }

  // The other replicas' ranks write their layers' buffers (BatchNorm's
  // running statistics are per replica, Note [Each replica's buffers] in
  // checkpoint_state.h), when they have any, and tell rank 0.
  if (!writer && is_ok(begun)) {
    std::string part = ok("");
    try {
      const auto buffers =
          gpipe::detail::replica_buffers_of(layers_of(stage), mesh.data_rank());
      if (!buffers.empty()) {
        const auto file = "replica-" + std::to_string(mesh.data_rank()) +
                          "-rank-" + std::to_string(pipeline_rank) + ".bin";
        part = ok(nlohmann::json{
            {"file", file},
            {"written", gpipe::detail::write_tensor_file(tmp, file, buffers)}}
                      .dump());
      }
    } catch (...) {
      part = fail_here();
    }
    store.set(
        prefix + "buffers" + std::to_string(world.rank()), bytes_of(part));
  }

  // Rank 0 writes the manifest once every file is on disk.
  if (world.rank() == 0) {
    std::string done = ok("");
    if (!is_ok(begun)) {
      done = failed("rank 0 could not begin it: " + tmp);
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
          const auto result =
              read(world, prefix + key, from, "save_checkpoint");
          TORCH_CHECK(is_ok(result), failed, ": ", value_of(result));
          return value_of(result);
        };
        for (const auto r : c10::irange(mesh.pipeline_size())) {
          const auto part = nlohmann::json::parse(reported(
              "part" + std::to_string(r),
              r,
              c10::str(
                  "pipeline rank ", r, " could not write its partitions")));
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
        done = own ? failed(detail::message_of(std::current_exception()))
                   : fail_here();
      }
    }
    if (!is_ok(done) && is_ok(begun)) {
      // An unfinished checkpoint takes no room until the next save (every
      // writer has reported, so none writes into it any more; one renamed
      // into place is not there).
      (void)gpipe::detail::remove_tree(tmp);
    }
    store.set(prefix + "done", bytes_of(done));
  }
  const auto done = read(world, prefix + "done", 0, "save_checkpoint");
  std::vector<std::string> keys{"tmp", "done"};
  for (const auto r : c10::irange(world.size())) {
    keys.push_back("call" + std::to_string(r));
  }
  for (const auto r : c10::irange(mesh.pipeline_size())) {
    keys.push_back("part" + std::to_string(r));
  }
  for (const auto r : c10::irange(mesh.pipeline_size(), world.size())) {
    keys.push_back("buffers" + std::to_string(r));
  }
  forget(world, prefix, keys);
  if (!is_ok(done) && own) {
    std::rethrow_exception(own);
  }
  TORCH_CHECK(
      is_ok(done), "gpipe::dist::save_checkpoint failed: ", value_of(done));
}

TrainingState load_checkpoint(
    const std::string& dir,
    PipelineStage& stage,
    torch::optim::Optimizer& optimizer) {
  TORCH_CHECK_VALUE(
      !stage.is_empty(),
      "gpipe::dist::load_checkpoint expects a non-null PipelineStage");
  const auto& world = stage->mesh().world();
  auto& store = *world.store();
  const auto prefix = unique_prefix(world);
  std::exception_ptr disagreed;
  try {
    agree_on_call(
        world,
        prefix,
        "load_checkpoint",
        c10::str("load_checkpoint(optimizer ", kind_of(optimizer), ")"));
  } catch (...) {
    disagreed = std::current_exception();
  }
  if (disagreed) {
    std::vector<std::string> keys;
    for (const auto r : c10::irange(world.size())) {
      keys.push_back("call" + std::to_string(r));
    }
    forget(world, prefix, keys);
    std::rethrow_exception(disagreed);
  }
  // Rank 0 says which checkpoint: a save may not be seen alike by all.
  if (world.rank() == 0) {
    std::string chosen;
    try {
      const auto newest = latest_checkpoint(dir);
      chosen = ok(newest.empty() ? dir : newest);
    } catch (...) {
      chosen = failed(detail::message_of(std::current_exception()));
    }
    store.set(prefix + "path", bytes_of(chosen));
  }
  const auto chosen = read(world, prefix + "path", 0, "load_checkpoint");
  const auto path = value_of(chosen);

  TrainingState state;
  std::function<void()> apply;
  std::exception_ptr error;
  try {
    TORCH_CHECK_VALUE(is_ok(chosen), path);
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
    agree(
        world,
        prefix,
        "load_checkpoint",
        error ? detail::message_of(error) : std::string());
  } catch (...) {
    agreed = std::current_exception();
  }
  std::vector<std::string> keys{"path"};
  for (const auto r : c10::irange(world.size())) {
    keys.push_back("rank" + std::to_string(r));
    keys.push_back("call" + std::to_string(r));
  }
  forget(world, prefix, keys);
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

}  // namespace gpipe::dist
