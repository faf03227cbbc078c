#include "dist/agreement.h"

#include <c10/util/irange.h>
#include <gpipe/gpipe.h>
#include <gpipe/schedule.h>
#include <gpipe/skip.h>
#include <gpipe/verify.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dist/backend.h"
#include "dist/collective_pass.h"
#include "engine/partitions.h"
#include "text.h"

namespace gpipe::dist::detail {

namespace {

std::string join_fields(
    const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string out;
  for (const auto& f : fields) {
    out += f.first + "=" + f.second + "\n";
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> split_fields(
    const std::string& text) {
  std::vector<std::pair<std::string, std::string>> fields;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) {
      fields.emplace_back(line.substr(0, eq), line.substr(eq + 1));
    }
  }
  return fields;
}

}  // namespace

void verify_stage_options(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    int64_t ranks) {
  const auto n = static_cast<int64_t>(options.balance().size());
  gpipe::detail::verify_options(module, options, "gpipe::dist::PipelineStage");
  const auto v = options.stages_per_lane();
  if (!options.placement().empty()) {
    // Lane l is pipeline rank l.
    verify_placement(
        options.placement(),
        n,
        ranks,
        "gpipe::dist::PipelineStage (one lane per pipeline rank)");
    // Rank 0 reads the input and starts every pass.
    TORCH_CHECK_VALUE(
        options.placement().lane_of(0) == 0,
        "gpipe::dist::PipelineStage reads the input on pipeline rank 0, so "
        "the placement must put partition 0 on lane 0, but ",
        to_string(options.placement()),
        " puts it on lane ",
        options.placement().lane_of(0));
  }
  TORCH_CHECK_VALUE(
      !options.placement().empty() || n == ranks * v,
      "gpipe::dist::PipelineStage puts partition j on pipeline rank j % "
      "pipeline size (the World's size without a Mesh), so balance must "
      "have pipeline size x stages_per_lane = ",
      ranks,
      " x ",
      v,
      " = ",
      gpipe::detail::count_of(ranks * v, "partition", "partitions"),
      ", but it has ",
      n);
  TORCH_CHECK_VALUE(
      options.chunks() <= kMaxMicroBatches,
      "gpipe::dist::PipelineStage supports at most ",
      kMaxMicroBatches,
      " chunks, but got ",
      options.chunks());
  TORCH_CHECK_VALUE(
      n <= kMaxIndex,
      "gpipe::dist::PipelineStage supports at most ",
      kMaxIndex,
      " ranks, but got ",
      n);
}

std::vector<SkipPlace> skips_by_place(const torch::nn::Sequential& module) {
  std::map<gpipe::SkipKey, SkipPlace> places;
  int64_t index = 0;
  for (const auto& child : module->children()) {
    if (const auto* layer = gpipe::as_skippable(*child)) {
      for (const auto& key : layer->stashable()) {
        auto& place = places[key];
        place.stash_layer = index;
        place.name = key.name;
        place.key = key;
      }
      for (const auto& key : layer->poppable()) {
        places[key].pop_layer = index;
      }
    }
    ++index;
  }
  std::vector<SkipPlace> out;
  for (auto& entry : places) {
    out.push_back(std::move(entry.second));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::pair<std::string, std::string>> fingerprint(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    int64_t world_size) {
  std::vector<std::pair<std::string, std::string>> fields;
  auto str = [](const auto& v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  fields.emplace_back("world size", str(world_size));
  fields.emplace_back("balance", str(c10::IntArrayRef(options.balance())));
  fields.emplace_back("chunks", str(options.chunks()));
  fields.emplace_back("stages_per_lane", str(options.stages_per_lane()));
  fields.emplace_back(
      "placement", to_string(gpipe::detail::placement_of(options)));
  fields.emplace_back("checkpoint", to_string(options.checkpoint()));
  fields.emplace_back(
      "deferred_batch_norm", options.deferred_batch_norm() ? "true" : "false");
  // Hashes: every rank reads every other's fields, and the lists in full
  // are read only when a hash differs (fingerprint_details).
  const auto details = fingerprint_details(module);
  fields.emplace_back(
      "layers",
      str(module->size()) + " layers, whose names and types hash to " +
          str(std::hash<std::string>{}(details[0].second)));
  fields.emplace_back(
      "parameters and buffers",
      "whose names, shapes and dtypes hash to " +
          str(std::hash<std::string>{}(details[1].second)));
  // Each skip's name and layers: ranks that disagree would otherwise send
  // one skip's tensor where another of the same shape is expected.
  std::ostringstream skips;
  for (const auto& place : skips_by_place(module)) {
    skips << (skips.tellp() > 0 ? ", " : "") << "'" << place.name
          << "' from layer " << place.stash_layer << " to layer "
          << place.pop_layer;
  }
  fields.emplace_back("skips", skips.tellp() > 0 ? skips.str() : "none");
  return fields;
}

std::vector<std::pair<std::string, std::string>> fingerprint_details(
    const torch::nn::Sequential& module) {
  std::ostringstream layers;
  std::ostringstream tensors;
  for (const auto& named : module->named_children()) {
    layers << (layers.tellp() > 0 ? "; " : "") << named.key() << ": "
           << named.value()->name();
  }
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    tensors << (tensors.tellp() > 0 ? "; " : "") << name << " " << t.sizes()
            << " " << t.scalar_type();
  };
  for (const auto& p : module->named_parameters()) {
    add(p.key(), p.value());
  }
  for (const auto& b : module->named_buffers()) {
    add(b.key(), b.value());
  }
  return {{"layers", layers.str()}, {"parameters and buffers", tensors.str()}};
}

std::pair<std::string, std::string> first_difference(
    const std::string& mine, const std::string& theirs) {
  auto entries = [](const std::string& list) {
    std::vector<std::string> out;
    if (list.empty()) {
      return out;
    }
    size_t start = 0;
    while (true) {
      const auto end = list.find("; ", start);
      out.push_back(list.substr(start, end - start));
      if (end == std::string::npos) {
        return out;
      }
      start = end + 2;
    }
  };
  const auto a = entries(mine);
  const auto b = entries(theirs);
  auto quoted = [](const std::vector<std::string>& list, size_t k) {
    if (k >= list.size()) {
      return "nothing at entry " + std::to_string(k + 1) + " (" +
             std::to_string(list.size()) + " entries)";
    }
    return "'" + list[k] + "' (entry " + std::to_string(k + 1) + " of " +
           std::to_string(list.size()) + ")";
  };
  for (size_t k = 0; k < std::max(a.size(), b.size()); ++k) {
    if (k >= a.size() || k >= b.size() || a[k] != b[k]) {
      return {quoted(a, k), quoted(b, k)};
    }
  }
  return {mine, theirs};
}

void publish_build_error(
    Connection& connection, const std::string& prefix, const std::string& why) {
  const auto text = "error=" + why;
  connection.store->set(
      prefix + std::to_string(connection.rank),
      std::vector<uint8_t>(text.begin(), text.end()));
}

void agree_on_build(
    Connection& connection,
    const std::string& prefix,
    const std::vector<std::pair<std::string, std::string>>& mine,
    const std::vector<std::pair<std::string, std::string>>& details) {
  const auto rank = connection.rank;
  const auto size = connection.size;
  auto& store = connection.store;
  // The details first: a rank that reads this rank's fields may read them.
  if (!details.empty()) {
    const auto full = join_fields(details);
    store->set(
        prefix + std::to_string(rank) + "/details",
        std::vector<uint8_t>(full.begin(), full.end()));
  }
  const auto text = join_fields(mine);
  store->set(
      prefix + std::to_string(rank),
      std::vector<uint8_t>(text.begin(), text.end()));
  for (const auto r : c10::irange(size)) {
    if (r == rank) {
      continue;
    }
    std::vector<uint8_t> value;
    try {
      value = store->get(prefix + std::to_string(r));
    } catch (const std::exception&) {
      TORCH_CHECK(
          false,
          "gpipe::dist::PipelineStage: ",
          connection.rank_name(rank),
          " waited ",
          connection.timeout.count() / 1000.0,
          " s for ",
          connection.rank_name(r),
          " to build its stage [c10d: ",
          message_of(std::current_exception()).substr(0, 300),
          "]");
    }
    const std::string published(value.begin(), value.end());
    TORCH_CHECK_VALUE(
        published.rfind("error=", 0) != 0,
        "gpipe::dist::PipelineStage: ",
        connection.rank_name(r),
        " could not build its stage: ",
        published.substr(6));
    const auto theirs = split_fields(published);
    for (const auto k : c10::irange(mine.size())) {
      std::string own = mine[k].second;
      std::string other =
          k < theirs.size() ? theirs[k].second : std::string("(missing)");
      if (own == other) {
        continue;
      }
      // A field with details: its first entry that differs.
      for (const auto& d : details) {
        if (d.first != mine[k].first) {
          continue;
        }
        try {
          const auto value =
              store->get(prefix + std::to_string(r) + "/details");
          for (const auto& t :
               split_fields(std::string(value.begin(), value.end()))) {
            if (t.first == d.first) {
              std::tie(own, other) = first_difference(d.second, t.second);
            }
          }
        } catch (const std::exception&) {
          // Published before the fields, so there; the hashes say enough.
        }
      }
      TORCH_CHECK_VALUE(
          false,
          "gpipe::dist::PipelineStage: ",
          connection.rank_name(rank),
          " has ",
          mine[k].first,
          " ",
          own,
          " but ",
          connection.rank_name(r),
          " has ",
          other,
          ": every rank must build the same Sequential with the same "
          "GPipeOptions");
    }
  }
}

namespace {

// The kinds of c10::Error a refusal carries, by number.
constexpr int64_t kRefusalError = 0;
constexpr int64_t kRefusalValue = 1;
constexpr int64_t kRefusalType = 2;
constexpr int64_t kRefusalIndex = 3;

}  // namespace

int64_t refusal_kind_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::ValueError&) {
    return kRefusalValue;
  } catch (const c10::TypeError&) {
    return kRefusalType;
  } catch (const c10::IndexError&) {
    return kRefusalIndex;
  } catch (...) {
    return kRefusalError;
  }
}

std::exception_ptr refusal_error(int64_t kind, std::string message) {
  switch (kind) {
    case kRefusalValue:
      return std::make_exception_ptr(c10::ValueError(std::move(message), {}));
    case kRefusalType:
      return std::make_exception_ptr(c10::TypeError(std::move(message), {}));
    case kRefusalIndex:
      return std::make_exception_ptr(c10::IndexError(std::move(message), {}));
    default:
      return std::make_exception_ptr(c10::Error(std::move(message), {}));
  }
}

void refuse_pass(
    detail::Connection& connection,
    int64_t pass,
    const std::exception_ptr& error,
    std::vector<c10::intrusive_ptr<c10d::Work>>& sends) {
  TORCH_INTERNAL_ASSERT(connection.rank == 0);
  Begin refused;
  refused.refusal = message_of(error);
  refused.refusal_kind = refusal_kind_of(error);
  for (const auto r : c10::irange(int64_t{1}, connection.size)) {
    connection.send(
        r,
        pass,
        MessageId{MessageKind::Begin, 0, 0},
        Message{{refused.encode()}, true},
        sends);
  }
  throw AgreedRefusal{error};
}

Begin begin_pass(
    detail::Connection& connection,
    int64_t pass,
    Begin local,
    const std::vector<int64_t>& sizes,
    std::vector<c10::intrusive_ptr<c10d::Work>>& sends) {
  const auto rank = connection.rank;
  if (rank == 0) {
    local.sizes = sizes;
    for (const auto r : c10::irange(int64_t{1}, connection.size)) {
      connection.send(
          r,
          pass,
          MessageId{MessageKind::Begin, 0, 0},
          Message{{local.encode()}, true},
          sends);
    }
    return local;
  }
  auto m = connection.recv(0, pass, MessageId{MessageKind::Begin, 0, 0});
  TORCH_CHECK(m.tensors.size() == 1, "gpipe::dist: malformed begin message");
  auto theirs = Begin::decode(m.tensors[0]);
  if (!theirs.refusal.empty()) {
    throw AgreedRefusal{refusal_error(
        theirs.refusal_kind,
        c10::str(
            "gpipe::dist: ",
            connection.rank_name(0),
            " refused the pass before it began (",
            detail::describe_pass(pass),
            "): ",
            theirs.refusal,
            // (A replicas' refusal says so already.)
            theirs.refusal.find("the stage stays usable") == std::string::npos
                ? "; nothing ran, and the stage stays usable"
                : ""))};
  }
  auto differ = [&](const std::string& what,
                    const std::string& here,
                    const std::string& there,
                    const std::string& where = "") {
    TORCH_CHECK_VALUE(
        here == there,
        "gpipe::dist: ",
        connection.rank_name(rank),
        " runs ",
        what.empty() ? what : what + " ",
        here,
        " but ",
        connection.rank_name(0),
        " runs ",
        there,
        " (",
        detail::describe_pass(pass),
        "): every rank must run the same passes in the same order",
        where.empty() ? "" : "; " + where);
  };
  differ("pass", kind_name(local.kind), kind_name(theirs.kind));
  if (local.kind == PassKind::Train) {
    const auto mine = step_name(local.schedule, local.plan_hash);
    const auto rank0 = step_name(theirs.schedule, theirs.plan_hash);
    differ(
        "train_step with",
        mine,
        rank0,
        mine != rank0 && local.schedule == kPlanSchedule &&
                theirs.schedule == kPlanSchedule
            ? plans_differ(connection, local, theirs)
            : "");
  }
  differ(
      "in mode",
      local.training ? "train()" : "eval()",
      theirs.training ? "train()" : "eval()");
  // (A forward's cut is rank 0's alone, and it checkpoints nothing.)
  if (local.kind == PassKind::Train) {
    differ(
        "",
        "with chunks " + std::to_string(local.chunks),
        "with chunks " + std::to_string(theirs.chunks));
    auto mode = [](int64_t m) {
      return "with checkpoint " + to_string(static_cast<gpipe::Checkpoint>(m));
    };
    differ("", mode(local.checkpoint), mode(theirs.checkpoint));
  }
  differ(
      "with its checkpoint mode and chunks checkpointing the micro-batches "
      "below",
      std::to_string(local.checkpoint_stop),
      std::to_string(theirs.checkpoint_stop));
  TORCH_CHECK(
      !theirs.sizes.empty(),
      "gpipe::dist: rank 0 started a pass without micro-batches");
  return theirs;
}

}  // namespace gpipe::dist::detail
