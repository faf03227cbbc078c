// gpipe-bench --only speed: the training step of the speed model (an MLP
// of --blocks Linear+ReLU blocks) as the plain Sequential, as GPipe on one
// lane at every chunk count, and on two lanes in every checkpoint mode,
// against the fill-drain bound and this machine's parallel capacity.

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;

torch::nn::Sequential slice(
    const torch::nn::Sequential& net, int64_t from, int64_t to) {
  torch::nn::Sequential part;
  for (int64_t k = from; k < to; ++k) {
    part->push_back(*(net->begin() + k));
  }
  return part;
}

struct Row {
  std::string name;
  int64_t partitions = 0;
  int64_t chunks = 0;
  std::string checkpoint;
  double seconds = 0;
  double peak_mib = 0;
};

// Two threads each running half of the layers over the whole batch at once,
// against the same work one half after the other on one thread: what the
// two cores give when both are busy (shared caches and memory bandwidth).
// Each thread is started once and runs all its iterations, so thread start
// and per-thread BLAS buffers are not timed.
double parallel_capacity(
    const torch::nn::Sequential& net, const torch::Tensor& x, int iters) {
  const auto half = static_cast<int64_t>(net->size()) / 2;
  auto a = slice(net, 0, half);
  auto b = slice(net, half, net->size());
  auto work = [&x](torch::nn::Sequential& part, int times) {
    at::set_num_threads(1);
    for (int k = 0; k < times; ++k) {
      part->zero_grad();
      part->forward(x).pow(2).mean().backward();
    }
  };
  work(a, 1);
  work(b, 1);
  auto start = std::chrono::steady_clock::now();
  work(a, iters);
  work(b, iters);
  const double serial =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::thread warm([&] { work(b, 1); });
  warm.join();
  start = std::chrono::steady_clock::now();
  std::thread other([&] { work(b, iters); });
  work(a, iters);
  other.join();
  const double parallel =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return serial / parallel;
}

}  // namespace

nlohmann::json speed_section(
    torch::nn::Sequential net,
    const torch::Tensor& x,
    int iters,
    const std::vector<int64_t>& requested_chunks,
    bool quick) {
  const auto layers = static_cast<int64_t>(net->size());
  const auto chunk_list = chunk_counts_of(x.size(0), requested_chunks);
  std::vector<Row> rows;

  // The plain Sequential, with 1 and with 2 intra-op threads.
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    auto step = train_step(net, x);
    Row r{
        "plain-" + std::to_string(threads) + "t",
        1,
        1,
        "-",
        time_median(step, 2, iters),
        peak_mib(step)};
    rows.push_back(r);
  }
  at::set_num_threads(1);

  const double capacity = parallel_capacity(net, x, iters);

  // GPipe with one partition on one lane, one thread: the baselines, at
  // chunks 1 (the whole batch at once) and at every chunk count (the same
  // micro-batches, one after the other).
  std::map<int64_t, double> gpipe1;
  for (auto chunks : chunk_list) {
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({layers})
            .chunks(chunks)
            .checkpoint(Checkpoint::Never)
            .threads_per_lane(1));
    auto step = train_step(model, x);
    const double t = time_median(step, 2, iters);
    gpipe1[chunks] = t;
    rows.push_back({"gpipe-1p", 1, chunks, "never", t, peak_mib(step)});
  }
  if (!gpipe1.count(1)) {
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({layers})
            .chunks(1)
            .checkpoint(Checkpoint::Never)
            .threads_per_lane(1));
    gpipe1[1] = time_median(train_step(model, x), 2, iters);
  }

  for (auto mode :
       {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
    if (quick && mode != Checkpoint::Never) {
      continue;
    }
    for (auto chunks : chunk_list) {
      gpipe::GPipe model(
          net,
          gpipe::GPipeOptions({layers / 2, layers - layers / 2})
              .chunks(chunks)
              .checkpoint(mode)
              .threads_per_lane(1));
      auto step = train_step(model, x);
      const double t = time_median(step, 2, iters);
      rows.push_back(
          {"gpipe-2p", 2, chunks, gpipe::to_string(mode), t, peak_mib(step)});
    }
  }

  // The same pipeline with the lanes sharing the cores by the plan (the
  // default threads_per_lane 0): a cell the plan runs alone takes every
  // core (Note [Threads that follow the plan]).
  for (auto chunks : chunk_list) {
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({layers / 2, layers - layers / 2})
            .chunks(chunks)
            .checkpoint(Checkpoint::Never));
    auto step = train_step(model, x);
    const double t = time_median(step, 2, iters);
    rows.push_back({"gpipe-2p-shared", 2, chunks, "never", t, peak_mib(step)});
  }

  json configs = json::array();
  const double plain1 = rows[0].seconds;
  const double plain2 = rows[1].seconds;
  std::printf(
      "# parallel capacity of this machine (2 threads, half the layers "
      "each): "
      "%.3f\n",
      capacity);
  std::printf(
      "# speed-ups: vs_1p_c1 = over GPipe 1 partition chunks 1; vs_1p_cm = "
      "over GPipe 1 partition\n"
      "# with the same chunks (same micro-batches, one lane); attainable = "
      "2m / (2 + 2(m-1) / capacity):\n"
      "# the bound with the m-1 slots that run both lanes at once slowed by "
      "the capacity, the fill and drain slots not;\n"
      "# effic = vs_1p_cm / attainable; effic_c1 = vs_1p_c1 / attainable "
      "(2-partition rows of one thread per lane only)\n");
  std::printf(
      "%-15s %2s %6s %-12s %9s %8s %8s %9s %9s %6s %6s %6s %8s %9s\n",
      "config",
      "n",
      "chunks",
      "checkpoint",
      "step_ms",
      "vs_1p_c1",
      "vs_1p_cm",
      "vs_plain1",
      "vs_plain2",
      "bound",
      "attain",
      "effic",
      "effic_c1",
      "peak_MiB");
  for (const auto& r : rows) {
    const double n = r.partitions;
    const double m = r.chunks;
    const double bound = n * m / (m + n - 1);
    // Of fill-drain's m + 1 slots per pass on 2 lanes, m - 1 run both lanes
    // at once, each slowed to capacity / 2 of a lane alone; the other two
    // run one lane at full speed.
    const double attainable =
        r.partitions == 2 ? 2 * m / (2 + 2 * (m - 1) / capacity) : 1.0;
    const double vs_c1 = gpipe1[1] / r.seconds;
    const double vs_cm =
        r.partitions == 1 && r.name == "gpipe-1p"
            ? 1.0
            : (gpipe1.count(r.chunks) ? gpipe1[r.chunks] / r.seconds : vs_c1);
    // Only the 2-partition rows of one thread per lane have an efficiency
    // (null in the JSON, "-" in the table for the others).
    const bool rated = r.name == "gpipe-2p";
    const double efficiency = vs_cm / attainable;
    const double efficiency_c1 = vs_c1 / attainable;
    auto cell = [rated](double v, int width) {
      char text[32];
      if (rated) {
        std::snprintf(text, sizeof(text), "%*.3f", width, v);
      } else {
        std::snprintf(text, sizeof(text), "%*s", width, "-");
      }
      return std::string(text);
    };
    std::printf(
        "%-15s %2lld %6lld %-12s %9.1f %8.3f %8.3f %9.3f %9.3f %6.3f %6.3f "
        "%s %s %9.1f\n",
        r.name.c_str(),
        (long long)r.partitions,
        (long long)r.chunks,
        r.checkpoint.c_str(),
        r.seconds * 1e3,
        vs_c1,
        vs_cm,
        plain1 / r.seconds,
        plain2 / r.seconds,
        bound,
        attainable,
        cell(efficiency, 6).c_str(),
        cell(efficiency_c1, 8).c_str(),
        r.peak_mib);
    configs.push_back(
        {{"config", r.name},
         {"partitions", r.partitions},
         {"chunks", r.chunks},
         {"checkpoint", r.checkpoint},
         {"step_seconds", r.seconds},
         {"speedup_vs_gpipe_1p_chunks_1", vs_c1},
         {"speedup_vs_gpipe_1p_same_chunks", vs_cm},
         {"speedup_vs_plain_1t", plain1 / r.seconds},
         {"speedup_vs_plain_2t", plain2 / r.seconds},
         {"fill_drain_bound", bound},
         {"attainable", attainable},
         {"efficiency", rated ? json(efficiency) : json(nullptr)},
         {"efficiency_vs_chunks_1",
          rated ? json(efficiency_c1) : json(nullptr)},
         {"peak_mib", r.peak_mib}});
  }
  return {{"parallel_capacity", capacity}, {"configs", configs}};
}

}  // namespace gpipe::bench
