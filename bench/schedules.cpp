// gpipe-bench's schedules section: the four schedules through train_step.
//
// First on layers whose cost is fixed (gpipe::models::TimedLayer waits a
// set time in forward and in each part of backward), so that each step can
// be held against its own simulation and the bubbles compared without the
// machine's noise: n = 4 lanes, m = 8 micro-batches, 8 layers (2 per stage;
// interleaved: 1 per stage, 2 stages per lane). Then on real layers (16 x
// Linear(1024)+ReLU, 4 lanes of one thread sharing the cores): step time
// and peak memory of each schedule, one run.

#include <gpipe/gpipe.h>
#include <gpipe/models/timed.h>
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using gpipe::Schedule;

const Schedule kSchedules[] = {
    Schedule::FillDrain,
    Schedule::OneFOneB,
    Schedule::Interleaved1F1B,
    Schedule::ZeroBubble};

int64_t stages_per_lane_of(Schedule s) {
  return s == Schedule::Interleaved1F1B ? 2 : 1;
}

torch::Tensor mse(torch::Tensor y, torch::Tensor t) {
  return torch::mse_loss(y, t);
}

nlohmann::json timed_table(int iters) {
  const int64_t lanes = 4;
  const int64_t m = 8;
  const int64_t layers = 8;
  // Long enough that a sleep's overshoot (a fraction of a millisecond on a
  // busy machine) stays small against it.
  const auto part = std::chrono::microseconds(10000);
  const double unit = 10e-3;  // seconds per part of one layer
  std::printf(
      "\n# schedules on fixed-cost layers: %lld lanes, %lld micro-batches, "
      "%lld TimedLayers (forward, input and weight parts %.0f ms each)\n",
      (long long)lanes,
      (long long)m,
      (long long)layers,
      unit * 1e3);
  std::printf(
      "%-12s %9s %9s %7s %10s %10s %12s %10s\n",
      "schedule",
      "step_ms",
      "sim_ms",
      "ratio",
      "bubble_ms",
      "sim_bubble",
      "bubble/1f1b",
      "peak_live");
  nlohmann::json rows = nlohmann::json::array();
  double one_f_one_b_bubble = 0;
  for (auto schedule : kSchedules) {
    const auto v = stages_per_lane_of(schedule);
    const auto stages = lanes * v;
    torch::nn::Sequential net;
    for (int64_t k = 0; k < layers; ++k) {
      net->push_back(
          models::TimedLayer(16, models::TimedCosts{part, part, part}));
    }
    GPipe model(
        net,
        GPipeOptions(std::vector<int64_t>(stages, layers / stages))
            .chunks(m)
            .checkpoint(Checkpoint::Never)
            .stages_per_lane(v)
            .threads_per_lane(1));
    // The input requires grad, so that every stage's backward has both
    // parts, each as costly as its forward.
    auto x = torch::randn({m * 4, 16}).requires_grad_(true);
    auto t = torch::randn({m * 4, 16});
    const auto seconds = time_median(
        [&] {
          model->zero_grad();
          model->train_step(x, t, mse, schedule);
        },
        1,
        iters);
    // The same step simulated with the layers' costs.
    const double per_stage = unit * static_cast<double>(layers / stages);
    ActionCosts costs;
    costs.forward = per_stage;
    costs.backward = 2 * per_stage;
    costs.backward_input = per_stage;
    costs.backward_weight = per_stage;
    const auto plan = make_plan(schedule, m, lanes, v);
    const auto sim = simulate(plan, costs);
    double busy = 0;
    for (auto b : sim.busy) {
      busy += b;
    }
    busy /= static_cast<double>(lanes);
    const double bubble = seconds - busy;
    if (schedule == Schedule::OneFOneB) {
      one_f_one_b_bubble = bubble;
    }
    int64_t peak = 0;
    for (auto p : sim.lane_peak_live) {
      peak = std::max(peak, p);
    }
    const double bubble_ratio =
        one_f_one_b_bubble > 0 ? bubble / one_f_one_b_bubble : 0.0;
    std::printf(
        "%-12s %9.1f %9.1f %7.3f %10.1f %10.1f %12.3f %10lld\n",
        to_string(schedule).c_str(),
        seconds * 1e3,
        sim.makespan * 1e3,
        seconds / sim.makespan,
        bubble * 1e3,
        sim.bubble * 1e3,
        bubble_ratio,
        (long long)peak);
    rows.push_back(
        {{"schedule", to_string(schedule)},
         {"stages_per_lane", v},
         {"step_seconds", seconds},
         {"simulated_seconds", sim.makespan},
         {"step_over_simulation", seconds / sim.makespan},
         {"bubble_seconds", bubble},
         {"simulated_bubble_seconds", sim.bubble},
         {"bubble_over_1f1b", bubble_ratio},
         {"peak_live_micro_batches_per_lane", peak}});
  }
  return rows;
}

nlohmann::json real_table(int iters) {
  const int64_t lanes = 4;
  const int64_t m = 8;
  auto net = mlp(16, 1024);
  auto x = torch::randn({256, 1024});
  auto t = torch::zeros({256, 1024});
  std::printf(
      "\n# schedules on 16 x (Linear(1024,1024)+ReLU), batch 256, %lld "
      "lanes of 1 thread, %lld micro-batches, checkpoint never\n",
      (long long)lanes,
      (long long)m);
  std::printf(
      "%-12s %9s %10s %10s %10s\n",
      "schedule",
      "step_ms",
      "vs_1f1b",
      "peak_MiB",
      "vs_1f1b");
  nlohmann::json rows = nlohmann::json::array();
  double base_time = 0;
  double base_memory = 0;
  std::vector<std::pair<double, double>> results;
  for (auto schedule : kSchedules) {
    const auto v = stages_per_lane_of(schedule);
    const auto stages = lanes * v;
    GPipe model(
        net,
        GPipeOptions(std::vector<int64_t>(stages, 32 / stages))
            .chunks(m)
            .checkpoint(Checkpoint::Never)
            .stages_per_lane(v)
            .threads_per_lane(1));
    std::function<void()> step = [&] {
      model->zero_grad();
      model->train_step(x, t, mse, schedule);
    };
    const double seconds = time_median(step, 1, iters);
    const double memory = peak_mib(step);
    if (schedule == Schedule::OneFOneB) {
      base_time = seconds;
      base_memory = memory;
    }
    results.emplace_back(seconds, memory);
  }
  size_t k = 0;
  for (auto schedule : kSchedules) {
    const auto [seconds, memory] = results[k++];
    std::printf(
        "%-12s %9.1f %10.3f %10.1f %10.3f\n",
        to_string(schedule).c_str(),
        seconds * 1e3,
        seconds / base_time,
        memory,
        memory / base_memory);
    rows.push_back(
        {{"schedule", to_string(schedule)},
         {"stages_per_lane", stages_per_lane_of(schedule)},
         {"step_seconds", seconds},
         {"peak_mib", memory},
         {"time_over_1f1b", seconds / base_time},
         {"memory_over_1f1b", memory / base_memory}});
  }
  return rows;
}

}  // namespace

nlohmann::json schedules_section(int iters) {
  at::set_num_threads(1);
  return {{"fixed_cost", timed_table(iters)}, {"real", real_table(iters)}};
}

}  // namespace gpipe::bench
