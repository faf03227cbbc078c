// gpipe-bench's mesh section, run as `gpipe-run -n 4 -- gpipe-bench --only
// mesh`: two replicas of a 2-stage pipeline. (1) The gradient all-reduce
// of N bytes through gpipe's buckets (pack, all-reduce, average, unpack)
// against a bare c10d all-reduce of one tensor of N bytes on the same data
// group, timed in alternation. (2) How much of a step's all-reduce time is
// hidden under compute: 2 x 2 steps of an MLP under 1F1B, traced, the
// all-reduce intervals against the replica's compute intervals.

#include <gpipe/dist.h>
#include <gpipe/trace.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "dist/data_parallel.h"
#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using Clock = std::chrono::steady_clock;

bool is_compute(TraceKind kind) {
  return kind == TraceKind::Forward || kind == TraceKind::Backward ||
         kind == TraceKind::Recompute || kind == TraceKind::Weight ||
         kind == TraceKind::Loss || kind == TraceKind::Copy;
}

// Of the all-reduce intervals of `trace` (a replica's gathered steps), the
// microseconds spent while some lane of the replica computed, and in all.
std::pair<double, double> hidden_and_total(const Trace& trace) {
  std::vector<std::pair<double, double>> compute;
  std::vector<std::pair<double, double>> reduces;
  for (const auto& e : trace.events()) {
    if (e.kind == TraceKind::AllReduce) {
      reduces.emplace_back(e.start_us, e.end_us);
    } else if (is_compute(e.kind)) {
      compute.emplace_back(e.start_us, e.end_us);
    }
  }
  // The union of the compute intervals.
  std::sort(compute.begin(), compute.end());
  std::vector<std::pair<double, double>> merged;
  for (const auto& c : compute) {
    if (!merged.empty() && c.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, c.second);
    } else {
      merged.push_back(c);
    }
  }
  double hidden = 0;
  double total = 0;
  for (const auto& r : reduces) {
    total += r.second - r.first;
    for (const auto& c : merged) {
      hidden += std::max(
          0.0, std::min(r.second, c.second) - std::max(r.first, c.first));
    }
  }
  return {hidden, total};
}

}  // namespace

nlohmann::json mesh_section(
    const gpipe::dist::World& world, int64_t width, int iters) {
  using nlohmann::json;
  const auto rank = world.rank();
  const bool lead = rank == 0;
  at::set_num_threads(1);
  json out;
  if (world.size() != 4) {
    if (lead) {
      std::printf("\n# mesh: needs 4 ranks (gpipe-run -n 4)\n");
    }
    return out;
  }
  gpipe::dist::Mesh mesh(world, 2);
  const auto& data = mesh.data();

  // (1) The all-reduce of N bytes: gpipe's buckets against a bare one.
  if (lead) {
    std::printf(
        "\n# gradient all-reduce over 2 replicas (the first stages' data "
        "group): a bare c10d all-reduce of the same bytes (a sum), the same "
        "after a product by 1/replicas (an average: Gloo has no averaging "
        "all-reduce), and gpipe's buckets, in rotation (at least %d rounds, "
        "more for fewer bytes): the median of each, and the medians of the "
        "rounds' ratios of gpipe's to each\n",
        std::max(iters, 21));
    std::printf(
        "%-6s %8s %7s %10s %12s %10s %8s %11s\n",
        "MiB",
        "tensors",
        "rounds",
        "bare_ms",
        "bare_avg_ms",
        "gpipe_ms",
        "ratio",
        "ratio_avg");
  }
  json sizes = json::array();
  for (const int64_t mib : {1, 8, 32}) {
    // `mib` MiB of float parameters in 16 tensors.
    const int64_t count = 16;
    const int64_t each = mib * 1024 * 1024 / 4 / count;
    std::vector<torch::Tensor> params;
    for (int64_t k = 0; k < count; ++k) {
      auto p = torch::randn({each}).requires_grad_();
      p.mutable_grad() = torch::randn({each});
      params.push_back(p);
    }
    auto flat = torch::randn({each * count});
    // Made once, as a stage keeps them: the gradients then live in the
    // buckets, and a step all-reduces and averages them in place.
    gpipe::dist::detail::GradientBuckets buckets(
        data, params, gpipe::dist::detail::kDefaultBucketBytes);
    std::vector<double> bare;
    std::vector<double> bare_average;
    std::vector<double> ours;
    // Only the first stages' data group runs; the others wait, so that the
    // two groups do not share the cores. Smaller all-reduces get more
    // rounds (about as many bytes in all as 21 of 32 MiB), and the ratios
    // are taken round by round, so that a machine whose speed drifts during
    // the run moves every side of a round alike.
    const bool timed = mesh.pipeline_rank() == 0;
    const int rounds =
        std::max(iters, 21) * static_cast<int>(std::max<int64_t>(1, 32 / mib));
    // A bare all-reduce sums; an average over Gloo, which has no averaging
    // all-reduce, also takes one pass over the gradients (a product by
    // 1/replicas, as gpipe's buckets do).
    const double scale = 1.0 / static_cast<double>(data.size());
    auto time_bare = [&](bool average) {
      world.barrier();
      const auto start = Clock::now();
      if (timed) {
        if (average) {
          flat.mul_(scale);
        }
        std::vector<torch::Tensor> tensors{flat};
        data.group()->allreduce(tensors)->wait();
      }
      return seconds_since(start);
    };
    auto time_ours = [&] {
      world.barrier();
      const auto start = Clock::now();
      if (timed) {
        buckets.start();
        buckets.finish();
      }
      return seconds_since(start);
    };
    for (int k = 0; k < rounds + 3; ++k) {
      // Each side goes first in every third round.
      double times[3] = {0, 0, 0};
      for (int j = 0; j < 3; ++j) {
        const int side = (j + k) % 3;
        times[side] = side == 2 ? time_ours() : time_bare(side == 1);
      }
      if (k >= 3) {
        bare.push_back(times[0]);
        bare_average.push_back(times[1]);
        ours.push_back(times[2]);
      }
    }
    std::vector<double> ratios;
    std::vector<double> ratios_average;
    for (size_t k = 0; k < bare.size(); ++k) {
      ratios.push_back(bare[k] > 0 ? ours[k] / bare[k] : 1.0);
      ratios_average.push_back(
          bare_average[k] > 0 ? ours[k] / bare_average[k] : 1.0);
    }
    const double bare_s = quantile(bare, 0.5);
    const double bare_average_s = quantile(bare_average, 0.5);
    const double ours_s = quantile(ours, 0.5);
    const double ratio = quantile(ratios, 0.5);
    const double ratio_average = quantile(ratios_average, 0.5);
    if (lead) {
      std::printf(
          "%-6lld %8lld %7d %10.3f %12.3f %10.3f %8.3f %11.3f\n",
          static_cast<long long>(mib),
          static_cast<long long>(count),
          rounds,
          bare_s * 1e3,
          bare_average_s * 1e3,
          ours_s * 1e3,
          ratio,
          ratio_average);
    }
    sizes.push_back(
        {{"mib", mib},
         {"tensors", count},
         {"rounds", rounds},
         {"bare_seconds", bare_s},
         {"bare_average_seconds", bare_average_s},
         {"gpipe_seconds", ours_s},
         {"ratio", ratio},
         {"ratio_to_bare_average", ratio_average},
         {"target_ratio", 1.1}});
  }
  out["all_reduce"] = sizes;

  // (2) Hidden under compute: 2 x 2, 1F1B, an MLP of 4 blocks per stage.
  // With 64 rows a replica, a micro-batch's backward takes less time than a
  // stage's all-reduce, so the last stage's all-reduce outlasts the first
  // stage's last backward, the only compute left to hide it; with 256 rows
  // the same all-reduce meets four times the compute.
  const int64_t blocks = 8;
  if (lead) {
    std::printf(
        "\n# 2 replicas x 2 stages, %lld x Linear(%lld)+ReLU, 1F1B: the "
        "all-reduce time spent while the replica computes (hidden) over all "
        "of it, over %d traced steps\n",
        static_cast<long long>(blocks),
        static_cast<long long>(width),
        iters);
    std::printf(
        "%-6s %-8s %11s %14s %14s %10s %12s\n",
        "rows",
        "chunks",
        "bucket_MiB",
        "all_reduce_ms",
        "hidden_ms",
        "hidden",
        "step_ms");
  }
  json overlap = json::array();
  struct OverlapCase {
    int64_t batch;  // rows per replica
    int64_t chunks;
    int64_t bucket_mib;
  };
  for (const auto& [batch, chunks, bucket_mib] : std::vector<OverlapCase>{
           {64, 4, 25},
           {64, 8, 25},
           {64, 4, 4},
           {64, 8, 4},
           {256, 4, 25},
           {256, 8, 25}}) {
    torch::manual_seed(0);
    auto net = mlp(blocks, width);
    gpipe::dist::PipelineStage stage(
        net,
        gpipe::GPipeOptions({blocks, blocks})
            .chunks(chunks)
            .threads_per_lane(1),
        mesh);
    stage->set_gradient_bucket_bytes(bucket_mib * 1024 * 1024);
    auto x = torch::randn({batch, width});
    auto y = torch::randn({batch, width});
    auto loss_fn = [](torch::Tensor o, torch::Tensor t) {
      return torch::mse_loss(o, t);
    };
    const bool first = mesh.pipeline_rank() == 0;
    const bool last = mesh.pipeline_rank() == 1;
    auto step = [&] {
      stage->zero_grad();
      stage->train_step(
          first ? x : torch::Tensor(),
          last ? y : torch::Tensor(),
          loss_fn,
          gpipe::Schedule::OneFOneB);
    };
    step();  // warm-up
    step();
    auto trace = std::make_shared<Trace>();
    std::vector<double> steps;
    stage->set_trace(trace);
    for (int k = 0; k < iters; ++k) {
      world.barrier();
      const auto start = Clock::now();
      step();
      steps.push_back(seconds_since(start));
    }
    auto gathered = gpipe::dist::gather_trace(stage);
    stage->set_trace(nullptr);
    // Each replica's first stage has its replica's trace; replica 0's
    // numbers are printed.
    if (lead) {
      const auto [hidden, total] = hidden_and_total(*gathered);
      const double step_s = quantile(steps, 0.5);
      std::printf(
          "%-6lld %-8lld %11lld %14.3f %14.3f %9.0f%% %12.3f\n",
          static_cast<long long>(batch),
          static_cast<long long>(chunks),
          static_cast<long long>(bucket_mib),
          total / 1e3 / iters,
          hidden / 1e3 / iters,
          total > 0 ? 100 * hidden / total : 0.0,
          step_s * 1e3);
      overlap.push_back(
          {{"rows_per_replica", batch},
           {"chunks", chunks},
           {"bucket_mib", bucket_mib},
           {"all_reduce_ms_per_step", total / 1e3 / iters},
           {"hidden_ms_per_step", hidden / 1e3 / iters},
           {"hidden_fraction", total > 0 ? hidden / total : 0.0},
           {"target_hidden_fraction", 0.5},
           {"step_seconds", step_s}});
    }
  }
  out["overlap"] = overlap;
  return out;
}

}  // namespace gpipe::bench
