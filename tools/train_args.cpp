// gpipe-train's command line (see train_args.h; the models are in
// train_models.cpp).

#include "train_args.h"

#include <gpipe/gpipe.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace gpipe_train {

double lr_at(const Args& args, int64_t step, int64_t steps) {
  const double done =
      steps > 0 ? static_cast<double>(step) / static_cast<double>(steps) : 0;
  if (args.lr_schedule == "cosine") {
    return args.lr * 0.5 * (1.0 + std::cos(M_PI * done));
  }
  if (args.lr_schedule == "step") {
    return args.lr * (done >= 0.75 ? 0.01 : done >= 0.5 ? 0.1 : 1.0);
  }
  return args.lr;
}

// CLI11 reads integers with strtoll's base 0 and saturates, so "010" would
// be 8, "0x10" 16 and "99999999999999999999" INT64_MAX; it also wraps "-1"
// into an unsigned. Accept plain decimals that fit in T only.
template <typename T>
CLI::Validator decimal() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [rest, error] = std::from_chars(text.data(), end, value);
        if (error == std::errc::result_out_of_range) {
          return c10::str("'", text, "' is out of range");
        }
        if (text.empty() || error != std::errc() || rest != end) {
          return c10::str(
              "expected a ",
              std::is_signed<T>::value ? "" : "non-negative ",
              "decimal integer, but got '",
              text,
              "'");
        }
        return std::string();
      },
      /*validator_desc=*/"");
}

// CLI11 reads a double with strtod after trimming it, and an empty value
// as 0: "" was told as "--lr must be positive and finite, but got 0", and
// " 0.1" taken where "0.1 " was not. Accept a number written alone only.
CLI::Validator decimal_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const char* begin = text.c_str();
        char* end = nullptr;
        (void)std::strtod(begin, &end);
        // (strtod also reads hexadecimal, "0x1p-4", which the integer
        // flags refuse.)
        if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) ||
            end != begin + text.size() ||
            text.find_first_of("xX") != std::string::npos) {
          return c10::str("expected a number, but got '", text, "'");
        }
        return std::string();
      },
      /*validator_desc=*/"");
}

std::string exact_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

CLI::Validator decimal_int64() {
  return decimal<int64_t>();
}

// A file that a few steps' trace goes to: its folder must exist now, rather
// than the write failing after the training it recorded.
void verify_output_path(const std::string& flag, const std::string& path) {
  usage_check(!path.empty(), flag, " needs a file name");
  std::error_code ignored;
  usage_check(
      !fs::is_directory(path, ignored),
      flag,
      " '",
      path,
      "' is a folder; name a file in it");
  auto folder = fs::path(path).parent_path();
  if (folder.empty()) {
    folder = ".";
  }
  usage_check(
      fs::is_directory(folder, ignored),
      flag,
      " '",
      path,
      "': '",
      folder.string(),
      fs::exists(folder, ignored) ? "' is not a folder"
                                  : "', its folder, does not exist");
  usage_check(
      ::access(folder.c_str(), W_OK) == 0,
      flag,
      " '",
      path,
      "': the folder '",
      folder.string(),
      "' is not writable");
  // A folder may take no new file all the same (/proc, a full or read-only
  // file system, an existing file without write permission): opened now,
  // without truncating what is there, and a file made for it removed.
  const bool existed = fs::exists(path, ignored);
  {
    std::ofstream probe(path, std::ios::app);
    usage_check(
        probe.good(),
        flag,
        " '",
        path,
        "' cannot be opened for writing: ",
        std::strerror(errno));
  }
  if (!existed) {
    fs::remove(path, ignored);
  }
}

void verify_data_dir(const std::string& dir) {
  constexpr const char* kWayOut =
      "; install Debian's dataset-fashion-mnist or pass the folder of the "
      "Fashion-MNIST *-ubyte.gz files";
  std::error_code ignored;
  usage_check(
      fs::is_directory(dir, ignored),
      "--data-dir '",
      dir,
      "' is not a folder",
      kWayOut);
  for (const char* file : kFashionMnistFiles) {
    const auto path = fs::path(dir) / file;
    usage_check(
        fs::is_regular_file(path, ignored),
        "--data-dir '",
        dir,
        fs::exists(path, ignored) ? "' holds " : "' has no ",
        file,
        fs::exists(path, ignored) ? ", but not as a file" : "",
        kWayOut);
  }
}

void refuse_repeated_switches(const CLI::App& app) {
  for (const auto* option : app.get_options()) {
    usage_check(
        option->get_expected_max() != 0 || option->count() <= 1,
        option->get_name(),
        " was given ",
        option->count(),
        " times; give it once");
  }
}

// gpipe-train's flags, with their defaults.

void add_options(CLI::App& app, Args& args) {
  std::vector<std::string> models;
  for (const auto& spec : model_specs()) {
    models.push_back(spec.name);
  }
  const auto int64 = decimal<int64_t>();
  app.add_option(
         "--model",
         args.model,
         "cnn: conv-BN-ReLU blocks; resnet: a small ResNet of bottlenecks; "
         "unet: a U-Net with a pooling classifier (skips cross partitions)")
      ->check(CLI::IsMember(models));
  app.add_option(
      "--data-dir", args.data_dir, "Folder with the gzipped IDX files");
  app.add_option(
         "--partitions",
         args.partitions,
         "Number of pipeline partitions, 1 to the model's layers (with "
         "--balance: its length)")
      ->check(int64);
  app.add_option(
      "--balance",
      args.balance_text,
      "Layers per partition, e.g. 6,7, summing to the model's layers "
      "(default: chosen by gpipe::balance_by_time on one micro-batch, and "
      "printed)");
  app.add_option(
         "--chunks",
         args.chunks,
         "Micro-batches per mini-batch, 1 to --batch-size")
      ->check(int64);
  app.add_option(
         "--checkpoint",
         args.checkpoint,
         "Which micro-batches keep only their input and recompute it in "
         "backward")
      ->check(CLI::IsMember({"always", "except_last", "never"}));
  app.add_option("--epochs", args.epochs, "Training epochs (at least 1)")
      ->check(int64);
  app.add_option(
         "--batch-size", args.batch_size, "Mini-batch size (at least 1)")
      ->check(int64);
  app.add_option(
         "--lr",
         args.lr,
         "SGD learning rate, positive and finite (momentum 0.9)")
      ->check(decimal_number());
  app.add_option(
         "--lr-schedule",
         args.lr_schedule,
         "constant; cosine: down to 0 over the run; step: x0.1 at half and "
         "at three quarters of the steps")
      ->check(CLI::IsMember({"constant", "cosine", "step"}));
  app.add_flag(
      "--deferred-batch-norm",
      args.deferred_batch_norm,
      "BatchNorm running statistics over the whole mini-batch, not per "
      "micro-batch (gpipe::DeferredBatchNorm)");
  app.add_option(
         "--threads-per-lane",
         args.threads_per_lane,
         c10::str(
             "Intra-op threads per CPU lane: 0 (automatic) or 1 to ",
             kMaxThreadsPerLane))
      ->check(int64);
  app.add_option(
         "--limit", args.limit, "Use only the first N training images (0: all)")
      ->check(int64);
  app.add_option(
         "--test-limit",
         args.test_limit,
         "Evaluate on only the first N test images (0: all)")
      ->check(int64);
  app.add_option(
         "--log-every",
         args.log_every,
         "Print progress every N steps (at least 1)")
      ->check(int64);
  app.add_option("--seed", args.seed, "Random seed")
      ->check(decimal<uint64_t>());
  app.add_flag(
      "--json",
      args.json,
      "Print a JSON summary line at the end; standard output then holds "
      "only it, and every other line goes to standard error");
  app.add_option(
         "--schedule",
         args.schedule,
         "autograd: forward, then loss.backward(); " + train_step_schedules() +
             ": train_step with the loss inside the pipeline (zero_bubble_v "
             "puts 2 partitions on each lane in a V: j and 2 lanes - 1 - j "
             "on lane j); under a launcher the default is fill_drain")
      ->check(CLI::IsMember(schedule_names()));
  app.add_option(
         "--stages-per-lane",
         args.stages_per_lane,
         "Partitions per lane, partition j on lane j % lanes (default 1; "
         "with --schedule interleaved or looped_bfs, 2 when the partitions "
         "are an even number of at least 4; always 2 with zero_bubble_v)")
      ->check(int64);
  app.add_option(
         "--pipeline-size",
         args.pipeline_size,
         "Under a launcher: ranks per pipeline, dividing the ranks; the "
         "others are replicas of it, each training on its own shard of every "
         "batch, gradients averaged (0: one pipeline over all ranks)")
      ->check(int64);
  app.add_option(
      "--plan",
      args.plan_path,
      "Run each step by this plan (CSV: one row per lane, actions such as "
      "0F3,1B3,1W3) instead of a schedule");
  app.add_option(
      "--trace",
      args.trace_path,
      "Write a Chrome trace JSON of a few steps here");
  app.add_option(
      "--timeline",
      args.timeline_path,
      "Write an SVG timeline of a few steps here (one row per lane; under a "
      "launcher, per rank of the first replica's pipeline)");
  app.add_option(
         "--trace-steps",
         args.trace_steps,
         "Steps to record for --trace/--timeline (from the second step; at "
         "least 1)")
      ->check(int64);
}

// Checks every flag and their agreement, and fills in args.balance; throws
// UsageError. Runs before the data is read or the model built. (Only that
// the run has enough steps for --trace-steps waits for the data.)
void verify_args(const CLI::App& app, Args& args) {
  const auto& spec = model_spec(args.model);
  usage_check(
      args.epochs >= 1, "--epochs must be at least 1, but got ", args.epochs);
  usage_check(
      args.batch_size >= 1,
      "--batch-size must be at least 1, but got ",
      args.batch_size);
  usage_check(
      args.chunks >= 1, "--chunks must be at least 1, but got ", args.chunks);
  // (--autotune chooses the chunks; a --plan's count is checked when it is
  // read, and --chunks may be left at its default then.)
  usage_check(
      args.autotune || app.count("--plan") > 0 ||
          args.chunks <= args.batch_size,
      "--chunks ",
      args.chunks,
      " is more than --batch-size ",
      args.batch_size,
      "; every micro-batch needs at least one sample");
  usage_check(
      std::isfinite(args.lr) && args.lr > 0,
      "--lr must be positive and finite, but got ",
      args.lr);
  usage_check(
      args.threads_per_lane >= 0 && args.threads_per_lane <= kMaxThreadsPerLane,
      "--threads-per-lane must be 0 (automatic) or 1 to ",
      kMaxThreadsPerLane,
      ", but got ",
      args.threads_per_lane);
  usage_check(
      args.limit >= 0,
      "--limit must be 0 (all images) or positive, but got ",
      args.limit);
  usage_check(
      args.test_limit >= 0,
      "--test-limit must be 0 (all images) or positive, but got ",
      args.test_limit);
  usage_check(
      args.log_every >= 1,
      "--log-every must be at least 1, but got ",
      args.log_every);

  const bool per_lane = app.count("--stages-per-lane") > 0;
  usage_check(
      args.stages_per_lane >= 1 && args.stages_per_lane <= spec.layers,
      "--stages-per-lane must be between 1 and ",
      spec.layers,
      ", but got ",
      args.stages_per_lane);
  verify_layout(app, args, per_lane);

  usage_check(
      args.trace_steps >= 1,
      "--trace-steps must be at least 1, but got ",
      args.trace_steps);
  const bool trace = app.count("--trace") > 0;
  const bool timeline = app.count("--timeline") > 0;
  usage_check(
      trace || timeline || app.count("--trace-steps") == 0 ||
          args.trace_steps == Args{}.trace_steps,
      "--trace-steps has no effect without --trace or --timeline");
  if (trace) {
    verify_output_path("--trace", args.trace_path);
  }
  if (timeline) {
    verify_output_path("--timeline", args.timeline_path);
  }
  if (trace && timeline) {
    std::error_code ignored;
    usage_check(
        fs::weakly_canonical(args.trace_path, ignored) !=
            fs::weakly_canonical(args.timeline_path, ignored),
        "--trace and --timeline both name '",
        args.trace_path,
        "'; give them different files");
  }

  if (!per_lane && !runs_in_a_v(args.schedule) &&
      own_stages_per_lane(args.schedule) == 2 && args.world_size == 1 &&
      args.partitions >= 4 && args.partitions % 2 == 0) {
    args.stages_per_lane = 2;
  }
  if (runs_in_a_v(args.schedule)) {
    usage_check(
        !per_lane || args.stages_per_lane == 2,
        "--schedule ",
        args.schedule,
        " runs 2 partitions on each lane (a V: partition j and 2 lanes - 1 "
        "- j on lane j), but --stages-per-lane is ",
        args.stages_per_lane);
    usage_check(
        args.partitions % 2 == 0,
        "--schedule ",
        args.schedule,
        " runs 2 partitions on each lane, so it needs an even number of "
        "partitions, but there are ",
        args.partitions);
    args.stages_per_lane = 2;
  }
  usage_check(
      args.stages_per_lane >= 1 && args.partitions % args.stages_per_lane == 0,
      "--stages-per-lane must be positive and divide the ",
      args.partitions,
      " partitions, but got ",
      args.stages_per_lane);
  usage_check(
      !per_lane || args.stages_per_lane == 1 || args.schedule != "autograd" ||
          app.count("--plan") > 0,
      "--stages-per-lane needs a train_step schedule (",
      train_step_schedules(),
      "), but --schedule is autograd");
  read_plan(app, args);

  // Last, so that an uninstalled data set does not hide other mistakes.
  verify_data_dir(args.data_dir);
}

int64_t world_size_from_env() {
  const char* text = std::getenv("WORLD_SIZE");
  if (text == nullptr || *text == '\0') {
    return 1;
  }
  int64_t value = 0;
  const auto* end = text + std::strlen(text);
  const auto result = std::from_chars(text, end, value);
  usage_check(
      result.ec == std::errc() && result.ptr == end && value >= 1,
      "WORLD_SIZE must be a positive integer (as gpipe-run and torchrun set "
      "it), but got '",
      text,
      "'");
  // One process: init_from_env, which checks RANK, is not called.
  const char* rank = std::getenv("RANK");
  usage_check(
      value > 1 || rank == nullptr || *rank == '\0' || std::string(rank) == "0",
      "RANK must be 0 when WORLD_SIZE is 1, but got '",
      rank == nullptr ? "" : rank,
      "'");
  return value;
}

void write_json_line(const nlohmann::json& summary) {
  std::cout << summary.dump() << std::endl;
  TORCH_CHECK(
      std::cout.good(),
      "cannot write the JSON summary to standard output (",
      std::strerror(errno),
      "): the run's results are lost");
}

// c10::Error messages may carry context on further lines; print one.
std::string one_line(const std::string& text) {
  std::string line;
  bool space = false;
  for (const char c : text) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      space = true;
      continue;
    }
    if (space && !line.empty()) {
      line += ' ';
    }
    space = false;
    line += c;
  }
  return line;
}

}  // namespace gpipe_train
