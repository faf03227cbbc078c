// gpipe-bench: training-step speed and memory of GPipe on CPU lanes against
// the plain Sequential, the machine's parallel capacity, and the engine's
// per-cell overhead. Prints a table; writes JSON to --json.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "../tools/cli_message.h"
#include "bench_main.h"
#include "harness.h"
#include "sections.h"

namespace {

using gpipe::Checkpoint;
using gpipe::bench::peak_mib;
using gpipe::bench::time_median;
using gpipe::bench::train_step;
using nlohmann::json;

using gpipe::bench::mlp;

// Whether `path` can be written now: opened for appending (which changes
// nothing in a file that exists) and, if it did not exist, removed again.
// A folder, a missing folder or a read-only place fails here, before the
// sections run, rather than after them.
bool writable(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ignored;
  if (path.empty() || fs::is_directory(path, ignored)) {
    return false;
  }
  const bool existed = fs::exists(path, ignored);
  const bool opened = std::ofstream(path, std::ios::app).is_open();
  if (opened && !existed) {
    fs::remove(path, ignored);
  }
  return opened;
}

// Writes `text` to `path`; false if any of it could not be written.
bool write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  return !out.fail();
}

// The launcher's WORLD_SIZE: 1 when it is not set (or empty), 0 when it is
// no positive integer (`abc`, `-2`, `3x`: refused by the caller).
int64_t world_size_from_env() {
  const char* text = std::getenv("WORLD_SIZE");
  if (text == nullptr || *text == '\0') {
    return 1;
  }
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < 1) {
    return 0;
  }
  return static_cast<int64_t>(value);
}

int bench_main(int argc, char** argv);

}  // namespace

int gpipe::bench::bench_program(int argc, char** argv) {
  try {
    return bench_main(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "gpipe-bench: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpipe-bench: %s\n", e.what());
  }
  return 1;
}

namespace {

int bench_main(int argc, char** argv) {
  CLI::App app{"gpipe benchmark: speed-up, memory and overhead on CPU lanes"};
  // --help shows every option's default beside it.
  app.option_defaults()->always_capture_default();
  int64_t blocks = 16;
  int64_t width = 1024;
  int64_t batch = 256;
  int iters = 5;
  std::string json_path = "gpipe-bench.json";
  std::vector<int64_t> chunk_list{1, 2, 4, 8, 16, 32};
  bool quick = false;
  std::vector<std::string> only;
  app.add_option(
         "--blocks",
         blocks,
         "Linear+ReLU blocks of the model of speed, inference, trace, "
         "microbatch and dist (at least 2: its rows cut it in two); the "
         "other sections build their own")
      ->check(CLI::Range(int64_t{2}, int64_t{4096}));
  app.add_option(
         "--width",
         width,
         "Features of each Linear of the model of speed, inference, trace, "
         "microbatch, dist and mesh")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  app.add_option(
         "--batch",
         batch,
         "Mini-batch size of speed, inference, trace, microbatch and dist")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option(
         "--iters",
         iters,
         "Timed iterations per configuration (median); cell-cost: runs of 101 "
         "pairs; overhead, random and trace's tiny-layer rows time fixed "
         "counts of pairs, memory measures one step")
      ->check(CLI::Range(1, 100000));
  app.add_option(
         "--chunks",
         chunk_list,
         "Chunk counts for speed's 2-partition rows (the other sections choose "
         "their own; a count the batch does not cut into is left out)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  app.add_option("--json", json_path, "Where to write the JSON results");
  app.add_flag(
      "--quick",
      quick,
      "speed: only chunks 8 and checkpoint never, whatever --chunks says "
      "(a smoke run)");
  app.add_option(
         "--only",
         only,
         "Run only these sections: speed, overhead, cell-cost, memory, "
         "schedules, "
         "inference, conv, trace, random, microbatch (the default: all of "
         "those); "
         "unet-speed, unet-memory, accuracy, autotune (minutes each: run "
         "only when "
         "named); checkpoint (only when named); dist and unet-speed under "
         "gpipe-run -n N, mesh under "
         "gpipe-run -n 4")
      ->check(CLI::IsMember(
          {"dist",
           "mesh",
           "autotune",
           "checkpoint",
           "unet-speed",
           "unet-memory",
           "accuracy",
           "speed",
           "overhead",
           "cell-cost",
           "memory",
           "schedules",
           "inference",
           "conv",
           "trace",
           "random",
           "microbatch"}));
  std::string dist_trace = "gpipe-bench-dist-trace";
  app.add_option(
      "--dist-trace",
      dist_trace,
      "Where the dist section writes its timeline (.svg and .json added)");
  std::string markdown_path;
  app.add_option(
      "--markdown",
      markdown_path,
      "Also write the results as Markdown tables here (scripts/benchmarks.sh "
      "builds docs/benchmarks.md from them)");
  std::string svg_dir;
  app.add_option(
      "--svg-dir",
      svg_dir,
      "Folder for the unet sections' SVG plots and timelines (none unless "
      "given)");
  double budget_mib = 256;
  app.add_option(
         "--budget-mib",
         budget_mib,
         "unet-memory: MiB per device (lane), at most 16384 (the models grow "
         "until a step no longer fits it)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            char* end = nullptr;
            const double value = std::strtod(text.c_str(), &end);
            if (text.empty() || *end != '\0' || !std::isfinite(value) ||
                value <= 0 || value > 16384) {
              return "expected a positive number of MiB up to 16384, but "
                     "got '" +
                     text + "'";
            }
            return std::string();
          },
          // (CLI11's PositiveNumber and Range print DBL_MAX in 309 digits,
          // or a range from 0, and let NaN through.)
          "POSITIVE, AT MOST 16384"));
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  app.add_option("--data-dir", data_dir, "accuracy: Fashion-MNIST's folder");
  int seeds = 3;
  int64_t accuracy_epochs = 2;
  int64_t accuracy_limit = 20000;
  app.add_option("--seeds", seeds, "accuracy: seeds per configuration")
      ->check(CLI::Range(1, 100));
  app.add_option("--accuracy-epochs", accuracy_epochs, "accuracy: epochs")
      ->check(CLI::Range(int64_t{1}, int64_t{1000}));
  app.add_option(
         "--accuracy-limit",
         accuracy_limit,
         "accuracy: the first N training images")
      ->check(CLI::Range(int64_t{128}, int64_t{60000}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help is a ParseError with exit code 0; the others get exit status 2
    // rather than CLI11's codes (above 100), on one line.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(e);
    }
    std::fprintf(
        stderr,
        "gpipe-bench: %s (see gpipe-bench --help)\n",
        gpipe::tools::cli_message(e, &app).c_str());
    return 2;
  }
  if (const auto empty = gpipe::tools::empty_switch_value(app, argc, argv);
      !empty.empty()) {
    std::fprintf(
        stderr, "gpipe-bench: %s (see gpipe-bench --help)\n", empty.c_str());
    return 2;
  }
  // A file or folder flag given empty (--markdown '') would be taken as
  // not given, and its results lost.
  for (const auto& [flag, path] :
       {std::pair<const char*, const std::string&>{"--json", json_path},
        {"--markdown", markdown_path},
        {"--svg-dir", svg_dir},
        {"--dist-trace", dist_trace}}) {
    if (app.count(flag) > 0 && path.empty()) {
      std::fprintf(
          stderr,
          "gpipe-bench: %s expects a path, but got ''; leave the flag out "
          "for its default\n",
          flag);
      return 2;
    }
  }
  if (!markdown_path.empty()) {
    namespace fs = std::filesystem;
    std::error_code ignored;
    const auto same = fs::equivalent(json_path, markdown_path, ignored) ||
                      fs::absolute(json_path).lexically_normal() ==
                          fs::absolute(markdown_path).lexically_normal();
    if (same) {
      std::fprintf(
          stderr,
          "gpipe-bench: --markdown '%s' is the file --json '%s' names: the "
          "tables would overwrite the JSON; give them two files\n",
          markdown_path.c_str(),
          json_path.c_str());
      return 2;
    }
  }
  for (const auto& [flag, path] :
       {std::pair<const char*, const std::string&>{"--json", json_path},
        {"--markdown", markdown_path}}) {
    if ((flag == std::string("--json") || !path.empty()) && !writable(path)) {
      std::fprintf(
          stderr,
          "gpipe-bench: %s '%s' cannot be written (a folder, a missing "
          "folder or no permission); name a file in a writable folder\n",
          flag,
          path.c_str());
      return 2;
    }
  }
  // The sections' own files: a folder that cannot take them fails here,
  // not after minutes of measuring (when the JSON would be lost too).
  if (!svg_dir.empty() &&
      !writable(
          (std::filesystem::path(svg_dir) / ".gpipe-bench-probe").string())) {
    std::fprintf(
        stderr,
        "gpipe-bench: --svg-dir '%s' is not a folder this user can write "
        "into; name an existing, writable folder\n",
        svg_dir.c_str());
    return 2;
  }
  auto named = [&only](const std::string& section) {
    return std::find(only.begin(), only.end(), section) != only.end();
  };
  auto want = [&only, &named](const std::string& section) {
    return only.empty() || named(section);
  };
  // The exit status: 1 when a file could not be written after all.
  auto write_results = [&](const json& results) {
    if (!write_file(json_path, results.dump(2) + "\n")) {
      std::fprintf(
          stderr,
          "gpipe-bench: could not write --json '%s'\n",
          json_path.c_str());
      return 1;
    }
    std::printf("\n# JSON written to %s\n", json_path.c_str());
    if (!markdown_path.empty()) {
      if (!write_file(markdown_path, gpipe::bench::to_markdown(results))) {
        std::fprintf(
            stderr,
            "gpipe-bench: could not write --markdown '%s'\n",
            markdown_path.c_str());
        return 1;
      }
      std::printf("# Markdown written to %s\n", markdown_path.c_str());
    }
    return 0;
  };
  // Started as one rank of several (gpipe-run, torchrun): the dist section
  // (the default) or the U-Net speed table across the ranks, printed and
  // written by rank 0.
  const int64_t world_size = world_size_from_env();
  if (world_size == 0) {
    std::fprintf(
        stderr,
        "gpipe-bench: WORLD_SIZE must be a positive integer (as gpipe-run "
        "and torchrun set it), but got '%s'\n",
        std::getenv("WORLD_SIZE"));
    return 2;
  }
#if defined(GPIPE_NO_DIST)
  if (world_size > 1 || named("dist") || named("mesh")) {
    std::fprintf(
        stderr,
        "gpipe-bench: this build has no gpipe::dist (-DGPIPE_DIST=OFF): the "
        "dist and mesh sections and runs under a launcher are not "
        "available\n");
    return 2;
  }
#else
  if (world_size > 1) {
    for (const auto& section : only) {
      if (section != "dist" && section != "unet-speed" && section != "mesh") {
        std::fprintf(
            stderr,
            "gpipe-bench: under a launcher only --only dist, mesh and "
            "unet-speed run, but got --only %s\n",
            section.c_str());
        return 2;
      }
    }
    if (want("dist") && !writable(dist_trace + ".svg")) {
      std::fprintf(
          stderr,
          "gpipe-bench: --dist-trace '%s': '%s.svg' cannot be written (a "
          "folder, a missing folder or no permission)\n",
          dist_trace.c_str(),
          dist_trace.c_str());
      return 2;
    }
    if (named("mesh") && world_size != 4) {
      std::fprintf(
          stderr,
          "gpipe-bench: --only mesh runs on 4 ranks (2 replicas of a 2-stage "
          "pipeline), but WORLD_SIZE is %lld: run `gpipe-run -n 4 -- "
          "gpipe-bench --only mesh`\n",
          static_cast<long long>(world_size));
      return 2;
    }
    auto world = gpipe::dist::init_from_env();
    if (world.rank() == 0) {
      gpipe::bench::print_environment();
    }
    json out;
    if (named("mesh")) {
      out["mesh"] = gpipe::bench::mesh_section(world, width, iters);
    }
    if (want("dist")) {
      out["dist"] = gpipe::bench::dist_section(
          world, blocks, width, batch, iters, dist_trace);
    }
    if (named("unet-speed")) {
      out["unet_speed_ranks"] =
          gpipe::bench::unet_speed_dist_section(world, iters);
    }
    return world.rank() == 0 ? write_results(out) : 0;
  }
#endif
  // The sections across processes, named without a launcher.
  for (const auto& [section, ranks] :
       {std::pair<const char*, int>{"dist", 2}, {"mesh", 4}}) {
    if (named(section)) {
      std::fprintf(
          stderr,
          "gpipe-bench: --only %s needs ranks: run `gpipe-run -n %d -- "
          "gpipe-bench --only %s`\n",
          section,
          ranks,
          section);
      return 2;
    }
  }
  if (quick) {
    chunk_list = {8};
  }

  gpipe::bench::CountingAllocator::install();
  gpipe::bench::print_environment();

  json out;
  if (want("speed")) {
    // Made here, not for every section: its 64 MiB (at the defaults) stay
    // alive while it lives, and the memory sections count what is alive.
    torch::manual_seed(0);
    auto net = mlp(blocks, width);
    auto x = torch::randn({batch, width});
    std::printf(
        "# model: %lld x (Linear(%lld,%lld)+ReLU), batch %lld, training step "
        "= forward + backward\n",
        (long long)blocks,
        (long long)width,
        (long long)width,
        (long long)batch);
    out["speed"] =
        gpipe::bench::speed_section(net, x, iters, chunk_list, quick);
    out["speed"]["blocks"] = blocks;
    out["speed"]["width"] = width;
    out["speed"]["batch"] = batch;
  }

  if (want("overhead")) {
    out["overhead"] = gpipe::bench::overhead_section();
  }
  if (want("cell-cost")) {
    out["cell_cost"] = gpipe::bench::cell_cost_section(iters);
  }

  // Memory: wide activations, 32 layers, chunks 8, per checkpoint mode.
  if (want("memory")) {
    auto wide = mlp(16, 256);
    auto xw = torch::randn({4096, 256});
    json memory = json::array();
    std::printf(
        "\n# peak memory of a training step: 16 x (Linear(256,256)+ReLU), "
        "batch 4096, 2 partitions, chunks 8\n");
    std::printf("%-12s %10s %12s\n", "checkpoint", "peak_MiB", "vs_never");
    double never = 0;
    for (auto mode :
         {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
      gpipe::GPipe model(
          wide,
          gpipe::GPipeOptions({16, 16})
              .chunks(8)
              .checkpoint(mode)
              .threads_per_lane(1));
      auto step = train_step(model, xw);
      step();
      const double peak = peak_mib(step);
      if (mode == Checkpoint::Never) {
        never = peak;
      }
      std::printf(
          "%-12s %10.1f %12.3f\n",
          gpipe::to_string(mode).c_str(),
          peak,
          peak / never);
      memory.push_back(
          {{"checkpoint", gpipe::to_string(mode)},
           {"peak_mib", peak},
           {"ratio_to_never", peak / never}});
    }
    out["memory"] = memory;
  }

  // Schedules: each schedule through train_step on 4 lanes (and their
  // simulation).
  if (want("schedules")) {
    out["schedules"] = gpipe::bench::schedules_section(iters);
  }
  // The planner (minutes: only when named).
  if (named("autotune")) {
    out["autotune"] = gpipe::bench::autotune_section(iters);
  }

  // Inference: forward under InferenceMode, samples per second.
  if (want("inference")) {
    out["inference"] =
        gpipe::bench::inference_section(blocks, width, batch, iters);
  }
  if (want("conv")) {
    out["conv"] = gpipe::bench::conv_section(iters);
  }

  // Tracing: a training step with a trace on and off, timed in
  // alternation, on the speed model and on the tiny-layer model of the
  // overhead section (where per-cell costs show most).
  if (want("trace")) {
    auto traced = gpipe::bench::trace_section(blocks, width, batch, iters);
    out["trace"] = traced["trace"];
    out["trace_event_seconds"] = traced["event_seconds"];
  }

  if (want("random")) {
    out["random"] = gpipe::bench::random_section();
  }
  if (want("microbatch")) {
    out["microbatch"] =
        gpipe::bench::microbatch_section(blocks, width, batch, iters);
  }
  if (named("checkpoint")) {
    out["checkpoint"] = gpipe::bench::checkpoint_section(iters);
  }
  if (named("unet-speed")) {
    out["unet_speed"] = gpipe::bench::unet_speed_section(iters, svg_dir);
  }
  if (named("unet-memory")) {
    out["unet_memory"] = gpipe::bench::unet_memory_section(budget_mib, svg_dir);
  }
  if (named("accuracy")) {
    out["accuracy"] = gpipe::bench::accuracy_section(
        data_dir, seeds, accuracy_epochs, accuracy_limit);
  }
  return write_results(out);
}

}  // namespace
