// gpipe-train --autotune [--memory-limit SIZE]: the planner picks the
// balance, chunks, schedule (with its placement) and checkpoint mode for
// the lanes (--partitions in one process, the pipeline's ranks under a
// launcher), on rank 0, which tells the other ranks its choice.

#include <c10/util/Exception.h>
#include <gpipe/autotune.h>
#include <gpipe/checkpoint_io.h>
#include <gpipe/dist.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "train_args.h"

namespace gpipe_train {

void add_autotune_options(CLI::App& app, Args& args) {
  app.add_flag(
      "--autotune",
      args.autotune,
      "Let gpipe::autotune choose --balance, --chunks, --schedule (and its "
      "placement), --checkpoint and, in one process with "
      "--threads-per-lane 0, the threads per lane for the lanes "
      "(--partitions in one process, the pipeline's ranks under a "
      "launcher), under --memory-limit; prints its choice");
  app.add_option(
      "--memory-limit",
      args.memory_limit_text,
      "With --autotune: the most memory one lane may hold, in bytes or with "
      "a suffix K, M or G (binary), e.g. 256M (default: no limit)");
}

int64_t parse_memory_limit(const std::string& text) {
  // Digits, a fraction only before a suffix, at most 16384G: no hex, no
  // exponent, no spaces, which std::stod would take.
  constexpr double kMostBytes = 16384.0 * 1024 * 1024 * 1024;
  auto bad = [&] {
    return UsageError(c10::str(
        "--memory-limit '",
        text,
        "' is not a size: expected a positive whole number of bytes, or a "
        "number with a suffix K, M or G, such as 256M or 1.5G, at most "
        "16384G"));
  };
  size_t digits = 0;
  while (digits < text.size() &&
         std::isdigit(static_cast<unsigned char>(text[digits]))) {
    ++digits;
  }
  size_t end = digits;
  if (end < text.size() && text[end] == '.') {
    ++end;
    while (end < text.size() &&
           std::isdigit(static_cast<unsigned char>(text[end]))) {
      ++end;
    }
    if (end == digits + 1) {
      throw bad();  // "1." has no fraction
    }
  }
  if (digits == 0 || end + 1 < text.size()) {
    throw bad();
  }
  double scale = 1;
  if (end < text.size()) {
    switch (std::toupper(static_cast<unsigned char>(text[end]))) {
      case 'K':
        scale = 1024.0;
        break;
      case 'M':
        scale = 1024.0 * 1024.0;
        break;
      case 'G':
        scale = 1024.0 * 1024.0 * 1024.0;
        break;
      default:
        throw bad();
    }
  } else if (end != digits) {
    throw bad();  // a fraction of a byte
  }
  const double bytes =
      std::strtod(text.substr(0, end).c_str(), nullptr) * scale;
  if (!(bytes >= 1 && bytes <= kMostBytes)) {
    throw bad();
  }
  return static_cast<int64_t>(bytes);
}

void verify_autotune_options(const CLI::App& app, Args& args) {
  if (!args.autotune) {
    usage_check(
        app.count("--memory-limit") == 0,
        "--memory-limit is a limit for --autotune; give --autotune too");
    return;
  }
  for (const char* flag :
       {"--balance",
        "--chunks",
        "--schedule",
        "--plan",
        "--stages-per-lane",
        "--checkpoint"}) {
    usage_check(
        app.count(flag) == 0,
        "--autotune chooses ",
        flag,
        " itself; leave ",
        flag,
        " out");
  }
  if (app.count("--memory-limit") > 0) {
    args.memory_limit = parse_memory_limit(args.memory_limit_text);
  }
}

namespace {

// What rank 0 chose, as int64 words: chunks, schedule, checkpoint, the
// number of partitions, then the balance.
constexpr int64_t kWords = 260;

// The key of the choice in a checkpoint's user settings.
constexpr const char* kChoiceKey = "--autotune choice";

// The choice of a run resumed from `args.save_path`, as it saved it
// (autotune_choice_text), or nothing: none saved yet, or a run without
// --autotune.
// A checkpoint that cannot be read is left to --resume, which says why.
std::optional<std::string> saved_choice(const Args& args) {
  if (!args.resume) {
    return std::nullopt;
  }
  try {
    if (gpipe::latest_checkpoint(args.save_path).empty()) {
      return std::nullopt;
    }
    const auto state = gpipe::read_training_state(args.save_path);
    const auto found = state.user.find(kChoiceKey);
    if (found == state.user.end()) {
      return std::nullopt;
    }
    return found->second;
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

// A --memory-limit in bytes, as saved with a choice, as the messages give
// it ("": a choice saved before the limit was saved with it).
std::string limit_text(const std::string& bytes) {
  if (bytes.empty()) {
    return "(not saved)";
  }
  return bytes == "0" ? std::string("none") : bytes + " bytes";
}

// The value of `key` in autotune_choice_text's `text` ("" if none).
std::string field_of(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string field;
  while (in >> field) {
    if (field.rfind(key + "=", 0) == 0) {
      return field.substr(key.size() + 1);
    }
  }
  return "";
}

// autotune_choice_text's fields into `w` (the words rank 0 sends) and
// `threads`; false when malformed.
bool parse_choice(const std::string& text, int64_t* w, int64_t& threads) {
  std::map<std::string, std::string> f;
  std::istringstream in(text);
  std::string field;
  while (in >> field) {
    const auto eq = field.find('=');
    if (eq != std::string::npos) {
      f[field.substr(0, eq)] = field.substr(eq + 1);
    }
  }
  try {
    w[0] = std::stoll(f.at("chunks"));
    w[1] = static_cast<int64_t>(gpipe::schedule_from_string(f.at("schedule")));
    w[2] =
        static_cast<int64_t>(gpipe::checkpoint_from_string(f.at("checkpoint")));
    threads = std::stoll(f.at("threads"));
    std::istringstream balance(f.at("balance"));
    std::string part;
    int64_t n = 0;
    while (std::getline(balance, part, ',') && n + 4 < kWords) {
      w[4 + n++] = std::stoll(part);
    }
    w[3] = n;
    return n >= 1;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

std::string autotune_choice_text(const Args& args) {
  std::ostringstream text;
  const int64_t lanes =
      args.world_size > 1
          ? args.pipeline_size
          : args.partitions / std::max<int64_t>(1, args.stages_per_lane);
  text << "lanes=" << lanes << " chunks=" << args.chunks
       << " schedule=" << args.schedule << " checkpoint=" << args.checkpoint
       << " threads=" << args.threads_per_lane << " threads_asked="
       << (args.threads_per_lane_asked >= 0 ? args.threads_per_lane_asked
                                            : args.threads_per_lane)
       << " memory_limit=" << args.memory_limit << " balance=";
  for (size_t k = 0; k < args.balance.size(); ++k) {
    text << (k == 0 ? "" : ",") << args.balance[k];
  }
  return text.str();
}

void save_autotune_choice(
    const Args& args, std::map<std::string, std::string>& user) {
  if (args.autotune) {
    user[kChoiceKey] = autotune_choice_text(args);
  }
}

void autotune_args(
    Args& args,
    const torch::nn::Sequential& net,
    const torch::Tensor& images,
    const torch::Tensor& labels,
    const gpipe::dist::World* world,
    std::FILE* out) {
  const int64_t lanes = world != nullptr ? args.pipeline_size : args.partitions;
  auto words = torch::zeros({kWords}, torch::kLong);
  int64_t chosen_threads = args.threads_per_lane;
  args.threads_per_lane_asked = args.threads_per_lane;
  auto resumed = world == nullptr || world->rank() == 0 ? saved_choice(args)
                                                        : std::nullopt;
  if (resumed && field_of(*resumed, "lanes") != std::to_string(lanes)) {
    // Resumed in another layout (as any layout may): a choice for it.
    std::fprintf(
        out,
        "autotune: the choice saved in %s was for %s lanes; tuning for "
        "%lld\n",
        args.save_path.c_str(),
        field_of(*resumed, "lanes").c_str(),
        static_cast<long long>(lanes));
    resumed.reset();
  }
  if (resumed &&
      field_of(*resumed, "memory_limit") != std::to_string(args.memory_limit)) {
    // A run resumed with a lower --memory-limit (after running out of
    // memory, say) must not bring back the choice that did not fit.
    std::fprintf(
        out,
        "autotune: the choice saved in %s was for --memory-limit %s; tuning "
        "for %s\n",
        args.save_path.c_str(),
        limit_text(field_of(*resumed, "memory_limit")).c_str(),
        limit_text(std::to_string(args.memory_limit)).c_str());
    resumed.reset();
  }
  // The threads the choice was made for: as asked then (a choice saved
  // before that was kept says what it chose, which a later run asking for
  // 0, the tuner's choice, takes).
  const auto asked_then =
      field_of(resumed.value_or(std::string()), "threads_asked");
  if (resumed && (asked_then.empty()
                      ? args.threads_per_lane != 0 &&
                            field_of(*resumed, "threads") !=
                                std::to_string(args.threads_per_lane)
                      : asked_then != std::to_string(args.threads_per_lane))) {
    // An explicit --threads-per-lane is the user's, not the saved choice's.
    std::fprintf(
        out,
        "autotune: the choice saved in %s was for --threads-per-lane %s; "
        "tuning for %lld\n",
        args.save_path.c_str(),
        (asked_then.empty() ? field_of(*resumed, "threads") : asked_then)
            .c_str(),
        static_cast<long long>(args.threads_per_lane));
    resumed.reset();
  }
  if (resumed) {
    // Tuning times the layers: a second tuning may choose otherwise, and
    // the resumed run would not be the one it goes on from.
    if (!parse_choice(*resumed, words.data_ptr<int64_t>(), chosen_threads)) {
      words.zero_();  // refused below, on every rank
    }
    std::fprintf(
        out,
        "autotune: the choice saved in %s, not tuned again: %s\n",
        args.save_path.c_str(),
        resumed->c_str());
  } else if (world == nullptr || world->rank() == 0) {
    // Each replica trains on its own shard of a batch: that is the batch
    // the pipeline runs.
    const int64_t replicas =
        world != nullptr ? world->size() / args.pipeline_size : 1;
    const auto rows =
        std::min<int64_t>(args.batch_size / replicas, images.size(0));
    // Ranks do not share their cores by the plan: under a launcher the
    // choice is made for the count each rank keeps (PipelineStage's
    // default: the host's threads over its ranks).
    const int64_t threads =
        world != nullptr && args.threads_per_lane == 0
            ? std::max<int64_t>(
                  1,
                  static_cast<int64_t>(std::thread::hardware_concurrency()) /
                      std::max<int64_t>(1, world->local_size()))
            : args.threads_per_lane;
    auto options = gpipe::AutotuneOptions(lanes)
                       .memory_limit(args.memory_limit)
                       .batch_size(rows)
                       .threads_per_lane(threads);
    std::vector<int64_t> chunks;
    for (int64_t m = 1; m <= rows && m <= 32; m *= 2) {
      chunks.push_back(m);
    }
    options.chunks(chunks);
    const auto tuned = gpipe::autotune(
        net,
        images.narrow(0, 0, rows),
        labels.narrow(0, 0, rows),
        [](torch::Tensor y, torch::Tensor t) {
          return torch::nn::functional::cross_entropy(y, t);
        },
        options);
    // The choice (its first line), then the fastest candidates.
    if (replicas > 1) {
      std::fprintf(
          out,
          "autotune: for each replica's shard of a batch, %lld rows\n",
          static_cast<long long>(rows));
    }
    std::fprintf(out, "autotune: %s\n", tuned.report(4).c_str());
    auto* w = words.data_ptr<int64_t>();
    TORCH_CHECK(
        static_cast<int64_t>(tuned.balance.size()) <= kWords - 4,
        "autotune: a balance of more than ",
        kWords - 4,
        " partitions does not fit the message to the other ranks");
    chosen_threads = tuned.threads_per_lane;
    w[0] = tuned.chunks;
    w[1] = static_cast<int64_t>(tuned.schedule);
    w[2] = static_cast<int64_t>(tuned.checkpoint);
    w[3] = static_cast<int64_t>(tuned.balance.size());
    for (size_t k = 0; k < tuned.balance.size() && k + 4 < kWords; ++k) {
      w[k + 4] = tuned.balance[k];
    }
  }
  if (world != nullptr) {
    world->broadcast(words, 0);
  }
  const auto* w = words.data_ptr<int64_t>();
  TORCH_CHECK(
      w[3] >= 1 && w[3] <= kWords - 4,
      "gpipe-train: a malformed autotune choice from rank 0");
  args.chunks = w[0];
  args.schedule = gpipe::to_string(static_cast<gpipe::Schedule>(w[1]));
  args.checkpoint = gpipe::to_string(static_cast<gpipe::Checkpoint>(w[2]));
  args.partitions = w[3];
  args.balance.assign(w + 4, w + 4 + w[3]);
  args.balance_given = true;
  args.stages_per_lane = args.partitions / lanes;
  if (world == nullptr) {
    args.threads_per_lane = chosen_threads;
  }
}

}  // namespace gpipe_train
