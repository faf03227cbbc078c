// Training checkpoints of a PipelineStage: every rank calls, the first
// replica's pipeline ranks write their partitions, the other replicas'
// ranks their buffers, rank 0 the manifest.
// The format is the one-process one (src/checkpoint_io.h), so that any
// layout reads any other's.

#include <c10/util/irange.h>
#include <gpipe/dist.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <thread>
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

// Results travel through the store as "ok:<value>" or
// "error:<kind>:<message>", the kind of c10::Error as refusal_kind_of
// numbers it, so that another rank's ValueError is one here too.
std::string ok(const std::string& value) {
  return "ok:" + value;
}
std::string failed(const std::string& message, int64_t kind = 0) {
  return "error:" + std::to_string(kind) + ":" + message;
}
std::string failed(const std::exception_ptr& error) {
  return failed(detail::message_of(error), detail::refusal_kind_of(error));
}
bool is_ok(const std::string& result) {
  return result.rfind("ok:", 0) == 0;
}
std::string value_of(const std::string& result) {
  if (is_ok(result)) {
    return result.substr(3);
  }
  return result.substr(result.find(':', 6) + 1);
}
int64_t kind_of(const std::string& result) {
  return is_ok(result) ? 0 : std::atoll(result.c_str() + 6);
}
// Throws a failed result's error with its kind, `context` before it.
void check_result(const std::string& result, const std::string& context) {
  if (!is_ok(result)) {
    std::rethrow_exception(detail::refusal_error(
        kind_of(result), context + ": " + value_of(result)));
  }
}

// Note [Checkpoint calls within the timeout]
// Every rank of the World calls save_checkpoint or load_checkpoint at once,
// and they talk through the World's store. A wait for another rank's word
// is bounded by the World's timeout (a HashStore waits 300 s by default,
// whatever the World's is: so is a whole save, its writing included) and
// names the rank waited for; a rank that gives up says so in the store, and
// the others, which look for it while they wait, give up at once rather
// than wait out a timeout of their own. A World that failed meanwhile ends
// the wait with its failure. Every rank removes the call's keys, on every
// path, once all are past them (Forget). Before anything
// else the ranks say which call they make, and with what (a save's step and
// optimizer kind): a rank that calls load while another saves, or saves
// with another optimizer (which would write a manifest that names one kind
// over another's state, loadable by neither), fails every rank at once
// with a c10::ValueError naming both sides, and nothing is written.

// The value of `key`, which `from` sets, once it is there; `prefix` is the
// call's (see the Note).
std::string read(
    const World& world,
    const std::string& prefix,
    const std::string& key,
    int64_t from,
    const char* what) {
  using Clock = std::chrono::steady_clock;
  auto& store = *world.store();
  const auto& connection = *world.connection();
  const auto gave_up = prefix + "gave_up";
  // Rank 0 waits for the others and then says what it found: the others
  // wait for rank 0 a little longer, so that a rank that never came is
  // named by rank 0 (through gave_up), not rank 0 by them.
  const auto grace = from == 0 && world.rank() != 0
                         ? std::min<std::chrono::milliseconds>(
                               connection.timeout, std::chrono::seconds(5))
                         : std::chrono::milliseconds(0);
  const auto deadline = Clock::now() + connection.timeout + grace;
  // Polled with check, which answers at once: a TCPStore's wait that times
  // out leaves its answer on the socket, for the next request to read.
  constexpr auto kPoll = std::chrono::milliseconds(20);
  while (true) {
    bool there = false;
    try {
      there = store.check({key});
    } catch (const std::exception&) {
      connection.check();  // the World's failure, when it failed meanwhile
      TORCH_CHECK(
          false,
          "gpipe::dist::",
          what,
          ": ",
          connection.rank_name(world.rank()),
          " lost the job's store while it waited for ",
          connection.rank_name(from),
          " (rank 0, which hosts it, ended or stopped answering) [c10d: ",
          detail::message_of(std::current_exception()).substr(0, 200),
          "]");
    }
    if (there) {
      return string_of(store.get(key));
    }
    connection.check();
    if (store.check({gave_up})) {
      TORCH_CHECK(
          false,
          "gpipe::dist::",
          what,
          ": ",
          string_of(store.get(gave_up)),
          "; ",
          connection.rank_name(world.rank()),
          " gave up too");
    }
    if (Clock::now() >= deadline) {
      break;
    }
    std::this_thread::sleep_for(kPoll);
  }
  const auto message = c10::str(
      connection.rank_name(world.rank()),
      " waited ",
      (connection.timeout + grace).count() / 1000.0,
      " s for ",
      connection.rank_name(from),
      ", which had not reached it (every rank calls ",
      what,
      " together, between steps)");
  try {
    store.compareSet(gave_up, {}, bytes_of(message));
  } catch (const std::exception&) {
    // (No store to tell: the others find that out themselves.)
  }
  TORCH_CHECK(false, "gpipe::dist::", what, ": ", message);
}

// The optimizer's kind for agree_on_call; one a checkpoint cannot hold is
// refused by the writers (or readers) afterwards, on every rank alike.
std::string optimizer_kind_of(const torch::optim::Optimizer& optimizer) {
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
  const auto first = read(world, prefix, prefix + "call0", 0, what);
  for (const auto r : c10::irange(int64_t{1}, world.size())) {
    const auto theirs =
        read(world, prefix, prefix + "call" + std::to_string(r), r, what);
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
    const auto result = read(
        world,
        prefix,
        prefix + "rank" + std::to_string(r),
        r,
        "load_checkpoint");
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

// Once every rank is past a call's keys (under `prefix`), the last one to
// get here removes them from the store, so that a long run's checkpoints do
// not pile up there. Made when a call begins: its destructor runs on every
// path out of it, a failure's too.
class Forget {
 public:
  Forget(World world, std::string prefix)
      : world_(std::move(world)), prefix_(std::move(prefix)) {}
  Forget(const Forget&) = delete;
  Forget& operator=(const Forget&) = delete;
  ~Forget() {
    try {
      auto& store = *world_.store();
      if (store.add(prefix_ + "past", 1) != world_.size()) {
        return;
      }
      std::vector<std::string> keys{"tmp", "done", "path", "gave_up", "past"};
      for (const auto r : c10::irange(world_.size())) {
        for (const char* each : {"call", "part", "buffers", "rank"}) {
          keys.push_back(each + std::to_string(r));
        }
      }
      for (const auto& key : keys) {
        store.deleteKey(prefix_ + key);  // (false when it was never set)
      }
    } catch (const std::exception&) {
      // A store that is gone keeps nothing.
    }
  }

 private:
  World world_;
  std::string prefix_;
};

// A prefix of store keys that no other collective of this World uses
// (the same for a save and a load, so that ranks that call one each meet).
std::string unique_prefix(const World& world) {
  return "checkpoint/" + std::to_string(world.connection()->next_stage_id()) +
         "/";
}

}  // namespace

namespace {

// Runs a checkpoint call of `world`: an error of the store's that is not a
// c10::Error (a std::system_error, "Broken pipe", when rank 0 ended in the
// middle of it) becomes one, naming what failed, or the World's own failure
// when it failed meanwhile.
template <typename Call>
auto with_c10_errors(const World& world, const char* what, const Call& call) {
  try {
    return call();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    world.connection()->check();
    TORCH_CHECK(
        false,
        "gpipe::dist::",
        what,
        ": ",
        world.connection()->rank_name(world.rank()),
        " lost the job's store (rank 0, which hosts it, ended or stopped "
        "answering) [c10d: ",
        std::string(e.what()).substr(0, 200),
        "]");
  }
}

void save_on_ranks(
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
  const Forget forget(world, prefix);
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
    return failed(own);
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
  const auto begun = read(world, prefix, prefix + "tmp", 0, "save_checkpoint");
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
      done = failed("rank 0 could not begin it: " + tmp, kind_of(begun));
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
              read(world, prefix, prefix + key, from, "save_checkpoint");
          check_result(result, failed);
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
        done = own ? failed(std::current_exception()) : fail_here();
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
  const auto done = read(world, prefix, prefix + "done", 0, "save_checkpoint");
  if (!is_ok(done) && own) {
    std::rethrow_exception(own);
  }
  check_result(done, "gpipe::dist::save_checkpoint failed");
}

TrainingState load_on_ranks(
    const std::string& dir,
    PipelineStage& stage,
    torch::optim::Optimizer& optimizer) {
  TORCH_CHECK_VALUE(
      !stage.is_empty(),
      "gpipe::dist::load_checkpoint expects a non-null PipelineStage");
  const auto& world = stage->mesh().world();
  auto& store = *world.store();
  const auto prefix = unique_prefix(world);
  const Forget forget(world, prefix);
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
      chosen = ok(newest.empty() ? dir : newest);
    } catch (...) {
      chosen = failed(std::current_exception());
    }
    store.set(prefix + "path", bytes_of(chosen));
  }
  const auto chosen =
      read(world, prefix, prefix + "path", 0, "load_checkpoint");
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
  with_c10_errors(stage->mesh().world(), "save_checkpoint", [&] {
    save_on_ranks(dir, stage, optimizer, state);
    return 0;
  });
}

TrainingState load_checkpoint(
    const std::string& dir,
    PipelineStage& stage,
    torch::optim::Optimizer& optimizer) {
  TORCH_CHECK_VALUE(
      !stage.is_empty(),
      "gpipe::dist::load_checkpoint expects a non-null PipelineStage");
  return with_c10_errors(stage->mesh().world(), "load_checkpoint", [&] {
    return load_on_ranks(dir, stage, optimizer);
  });
}

}  // namespace gpipe::dist
