// gpipe-bench --only unet-speed under a launcher (`gpipe-run -n 2 --
// gpipe-bench --only unet-speed`, and -n 4): torchgpipe's speed table
// across processes. The U-Net of the single-process section, one stage per
// rank (two with the interleaved schedule), at 1, 4 and 32 micro-batches
// under each schedule, against the plain model and against the same
// pipeline as lanes of one process, timed in the same run on rank 0 while
// the other ranks wait.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "harness.h"
#include "sections.h"
#include "unet_case.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Rank 0's balance on every rank: balance_by_time measures, so ranks that
// each measured their own would disagree (and PipelineStage refuses that).
std::vector<int64_t> shared_balance(
    const gpipe::dist::World& world,
    int64_t partitions,
    torch::nn::Sequential& net,
    const torch::Tensor& sample) {
  auto b = torch::zeros({partitions}, torch::kLong);
  if (world.rank() == 0) {
    const auto mine = balance_by_time(partitions, net, sample, 0.3);
    b = torch::tensor(mine, torch::kLong);
  }
  world.broadcast(b, 0);
  return {b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + partitions};
}

// Rank 0's time for `step`, run on every rank between two barriers.
template <typename F>
double timed_on_all(const gpipe::dist::World& world, F step) {
  world.barrier();
  const auto start = Clock::now();
  step();
  world.barrier();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Case {
  Schedule schedule;
  int64_t stages_per_lane;
};

}  // namespace

json unet_speed_dist_section(const gpipe::dist::World& world, int iters) {
  const UNetSpeedCase unet;
  const int64_t B = UNetSpeedCase::B;
  const int64_t C = UNetSpeedCase::C;
  const int64_t batch = UNetSpeedCase::batch;
  const int64_t image = UNetSpeedCase::image;
  const auto ranks = world.size();
  const auto rank = world.rank();
  const bool lead = rank == 0;
  const auto& x = unet.x;
  const auto& y = unet.y;
  const auto make = &UNetSpeedCase::make;
  if (lead) {
    std::printf(
        "\n# unet-speed across %lld ranks: U-Net(%lld, %lld), batch %lld of "
        "3x%lldx%lld, training step (mse), checkpoint except_last, one "
        "thread per rank; one_process_ms: the same pipeline as %lld lanes "
        "of rank 0\n",
        (long long)ranks,
        (long long)B,
        (long long)C,
        (long long)batch,
        (long long)image,
        (long long)image,
        (long long)ranks);
  }
  // The plain model on rank 0 (1 and 2 threads) while the others wait.
  double plain_s[3] = {0, 0, 0};
  for (int threads : {1, 2}) {
    auto plain = make();
    at::set_num_threads(threads);
    std::vector<double> t;
    for (int k = 0; k < iters + 2; ++k) {  // the first two are not timed
      t.push_back(timed_on_all(world, [&] {
        if (lead) {
          plain->zero_grad();
          mse(plain->forward(x), y).backward();
        }
      }));
    }
    plain_s[threads] = median({t.begin() + 2, t.end()});
  }
  at::set_num_threads(1);
  if (lead) {
    std::printf(
        "plain: %.1f ms on 1 thread, %.1f ms on 2\n"
        "%-12s %5s %4s %6s %9s %9s %9s %9s %7s\n",
        plain_s[1] * 1e3,
        plain_s[2] * 1e3,
        "schedule",
        "ranks",
        "v",
        "chunks",
        "step_ms",
        "1proc_ms",
        "vs_1proc",
        "vs_plain1",
        "bound");
  }
  const std::vector<Case> cases{
      {Schedule::FillDrain, 1},
      {Schedule::OneFOneB, 1},
      {Schedule::Interleaved1F1B, 2},
      {Schedule::ZeroBubble, 1}};
  json rows = json::array();
  for (const auto& c : cases) {
    auto net = make();
    const auto balance = shared_balance(
        world, ranks * c.stages_per_lane, net, x.narrow(0, 0, batch / 4));
    for (int64_t m : {1, 4, 32}) {
      const auto options = GPipeOptions(balance)
                               .chunks(m)
                               .stages_per_lane(c.stages_per_lane)
                               .checkpoint(Checkpoint::ExceptLast)
                               .threads_per_lane(1);
      gpipe::dist::PipelineStage stage(make(), options, world);
      std::unique_ptr<GPipe> one;
      if (lead) {
        one = std::make_unique<GPipe>(make(), options);
      }
      // Timed in alternation, so that the machine's drift falls on both.
      // Two rounds of warm-up: a stage's second step still takes fresh
      // pages (the first takes hundreds of MiB of them).
      std::vector<double> t_dist;
      std::vector<double> t_one;
      for (int k = 0; k < iters + 2; ++k) {
        const double d = timed_on_all(world, [&] {
          stage->zero_grad();
          stage->train_step(
              rank == 0 ? x : torch::Tensor(),
              rank == ranks - 1 ? y : torch::Tensor(),
              mse,
              c.schedule);
        });
        const double o = timed_on_all(world, [&] {
          if (lead) {
            (*one)->zero_grad();
            (*one)->train_step(x, y, mse, c.schedule);
          }
        });
        if (k >= 2) {
          t_dist.push_back(d);
          t_one.push_back(o);
        }
      }
      const double dist_s = median(t_dist);
      const double one_s = median(t_one);
      const double bound = double(ranks) * m / (m + ranks - 1);
      const auto name = to_string(c.schedule);
      if (lead) {
        std::printf(
            "%-12s %5lld %4lld %6lld %9.1f %9.1f %9.3f %9.3f %7.3f\n",
            name.c_str(),
            (long long)ranks,
            (long long)c.stages_per_lane,
            (long long)m,
            dist_s * 1e3,
            one_s * 1e3,
            one_s / dist_s,
            plain_s[1] / dist_s,
            bound);
      }
      rows.push_back(
          {{"schedule", name},
           {"ranks", ranks},
           {"stages_per_lane", c.stages_per_lane},
           {"chunks", m},
           {"step_ms", dist_s * 1e3},
           {"one_process_ms", one_s * 1e3},
           {"speedup_vs_one_process", one_s / dist_s},
           {"samples_per_second", batch / dist_s},
           {"speedup_vs_plain_1t", plain_s[1] / dist_s},
           {"speedup_vs_plain_2t", plain_s[2] / dist_s},
           {"fill_drain_bound", bound}});
    }
  }
  return {
      {"model", UNetSpeedCase::model_json()},
      {"ranks", ranks},
      {"plain_ms_1t", plain_s[1] * 1e3},
      {"plain_ms_2t", plain_s[2] * 1e3},
      {"rows", rows}};
}

}  // namespace gpipe::bench
