// gpipe-bench's schedules section: the six schedules through train_step.
//
// First on layers whose cost is fixed (each a GELU and a
// gpipe::models::TimedLayer, which waits a set time in forward and in each
// part of backward), so that each step can be held against its own
// simulation and the bubbles compared without the machine's noise: n = 4
// lanes, m = 8 micro-batches, 16 layers (4 per stage; interleaved, looped
// BFS and ZB-V: 2 per stage, 2 stages per lane, ZB-V's in a V: with as
// many layers per stage, what each stage keeps at its boundaries, its
// input's copy and its output, weighs less against its layers). The bubble is
// read from a trace of the step (Trace::summary: each lane's idle time between
// the step's first and last interval), so that a layer's sleep running long
// counts as work and a lane waiting for its input as bubble; the nominal
// bubble, the step's time less the layers' set costs, is printed beside it. The
// memory is measured: the most one lane (one device) allocated above what it
// held before the step. The GELU gives the layers the memory that zero-bubble's
// claim rests on (Qi et al.: a micro-batch waiting for its weight part holds no
// more than one waiting for its backward, as in a transformer layer): per layer
// the forward keeps the GELU's input (for the input part only) and the
// TimedLayer's input, the waiting weight part the TimedLayer's input and
// output gradient; per stage the forward also keeps the stage's output.
// Then on real layers (16 x Linear(1024)+ReLU, 4 lanes of one thread sharing
// the cores), where a weight part keeps more than the forward did (a
// Linear's input and its output gradient, against its input alone): step
// time and peak memory of each schedule, one run; the peak of the whole
// step and the most one lane allocated above what it held before the step
// (its activations and transients, not its parameters and gradients).

#include <gpipe/gpipe.h>
#include <gpipe/models/timed.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using gpipe::Schedule;

// Adds to each row, for each (key, name), row[key] over 1F1B's row[key]
// as row[name] (0 where 1F1B's is not positive).
void add_ratios_to_1f1b(
    nlohmann::json& rows,
    const std::vector<std::pair<const char*, const char*>>& ratios) {
  nlohmann::json base;
  for (const auto& row : rows) {
    if (row["schedule"] == to_string(Schedule::OneFOneB)) {
      base = row;
    }
  }
  for (auto& row : rows) {
    for (const auto& [key, name] : ratios) {
      const double b = base[key].get<double>();
      row[name] = b > 0 ? row[key].get<double>() / b : 0.0;
    }
  }
}

// Runs `step` once and returns what each lane (allocation tags 1 ..
// lanes) allocated at most above what it held before the step, in bytes.
std::vector<double> lane_peak_bytes(
    CountingAllocator& counter,
    int64_t lanes,
    const std::function<void()>& step) {
  counter.reset_tag_peaks();
  std::vector<size_t> live(lanes);
  for (int64_t k = 0; k < lanes; ++k) {
    live[k] = counter.tag_peak(static_cast<int>(k) + 1);
  }
  step();
  std::vector<double> peaks(lanes);
  for (int64_t k = 0; k < lanes; ++k) {
    peaks[k] = static_cast<double>(
        counter.tag_peak(static_cast<int>(k) + 1) - live[k]);
  }
  return peaks;
}

// In KiB (the table's unit) or MiB, and their most.
std::vector<double> scaled(std::vector<double> bytes, double unit) {
  for (auto& b : bytes) {
    b /= unit;
  }
  return bytes;
}
double most(const std::vector<double>& values) {
  return *std::max_element(values.begin(), values.end());
}

nlohmann::json timed_table(int iters) {
  const int64_t lanes = 4;
  const int64_t m = 8;
  const int64_t layers = 16;
  // Each micro-batch's tensors are 4 x 1024 floats (16 KiB), large against
  // the step's small allocations, so that the lanes' peaks count
  // activations; the elementwise work on them is a few microseconds.
  const int64_t features = 1024;
  auto& counter = CountingAllocator::install();
  // Long enough that a sleep's overshoot (a fraction of a millisecond on a
  // busy machine) stays small against it.
  const auto part = std::chrono::microseconds(10000);
  const double unit = 10e-3;  // seconds per part of one layer
  std::printf(
      "\n# schedules on fixed-cost layers: %lld lanes, %lld micro-batches, "
      "%lld x (GELU + TimedLayer: forward, input and weight parts %.0f ms "
      "each); live: simulated peak live micro-batches per lane; lane_KiB: "
      "measured, the most one lane allocated above what it held before the "
      "step\n",
      (long long)lanes,
      (long long)m,
      (long long)layers,
      unit * 1e3);
  std::printf(
      "%-14s %8s %8s %6s %8s %8s %8s %8s %8s %8s %8s %5s %8s %8s\n",
      "schedule",
      "step_ms",
      "sim_ms",
      "ratio",
      "busy_ms",
      "sim_busy",
      "bubble",
      "sim_bub",
      "nominal",
      "bub/1f1b",
      "nom/1f1b",
      "live",
      "lane_KiB",
      "vs_1f1b");
  nlohmann::json rows = nlohmann::json::array();
  for (auto schedule : gpipe::schedules()) {
    const auto placement = gpipe::placement_for(schedule, lanes);
    const auto stages = placement.stages();
    const auto v = stages / lanes;
    // Each stage: a LaneTag of its lane (which copies the stage's input,
    // as a device holds what it receives), its layers, each a GELU and a
    // TimedLayer, and a CopyGradient (which copies the gradient coming
    // back, for the same reason).
    const auto layers_per_stage = layers / stages;
    torch::nn::Sequential net;
    for (int64_t j = 0; j < stages; ++j) {
      net->push_back(LaneTag(static_cast<int>(placement.lane_of(j)) + 1, true));
      for (int64_t k = 0; k < layers_per_stage; ++k) {
        net->push_back(torch::nn::GELU());
        net->push_back(
            models::TimedLayer(features, models::TimedCosts{part, part, part}));
      }
      net->push_back(CopyGradient());
    }
    GPipe model(
        net,
        GPipeOptions(std::vector<int64_t>(stages, 2 * layers_per_stage + 2))
            .chunks(m)
            .checkpoint(Checkpoint::Never)
            .placement(placement)
            .threads_per_lane(1));
    // The input requires grad, so that every stage's backward has both
    // parts, each as costly as its forward.
    auto x = torch::randn({m * 4, features}).requires_grad_(true);
    auto t = torch::randn({m * 4, features});
    const auto seconds = time_median(
        [&] {
          model->zero_grad();
          model->train_step(x, t, mse, schedule);
        },
        1,
        iters);
    // The same steps again, traced: each lane's real busy time and the
    // step's span from its first interval to its last.
    auto trace = std::make_shared<Trace>();
    model->set_trace(trace);
    std::vector<TraceSummary> traced;
    for (int k = 0; k < iters; ++k) {
      trace->clear();
      model->zero_grad();
      model->train_step(x, t, mse, schedule);
      traced.push_back(trace->summary());
    }
    model->set_trace(nullptr);
    // One more step, for the memory: the most one lane allocated above
    // what it held before the step.
    const auto lane_kib = scaled(
        lane_peak_bytes(
            counter,
            lanes,
            [&] {
              model->zero_grad();
              model->train_step(x, t, mse, schedule);
            }),
        1024.0);
    std::sort(traced.begin(), traced.end(), [](auto& a, auto& b) {
      return a.bubble < b.bubble;
    });
    const auto median = traced[traced.size() / 2];
    const double bubble = median.bubble;
    const double traced_busy = median.span - median.bubble;
    // The same step simulated with the layers' costs.
    const double per_stage = unit * static_cast<double>(layers / stages);
    ActionCosts costs;
    costs.forward = per_stage;
    costs.backward = 2 * per_stage;
    costs.backward_input = per_stage;
    costs.backward_weight = per_stage;
    const auto plan = make_plan(schedule, m, placement);
    const auto sim = simulate(plan, costs);
    double busy = 0;
    for (auto b : sim.busy) {
      busy += b;
    }
    busy /= static_cast<double>(lanes);
    // The step's time less the nominal work: also counts the layers'
    // sleeps running long and the step's own set-up as bubble.
    const double nominal = seconds - busy;
    int64_t peak = 0;
    for (auto p : sim.lane_peak_live) {
      peak = std::max(peak, p);
    }
    rows.push_back(
        {{"schedule", to_string(schedule)},
         {"stages_per_lane", v},
         {"step_seconds", seconds},
         {"simulated_seconds", sim.makespan},
         {"step_over_simulation", seconds / sim.makespan},
         {"traced_span_seconds", median.span},
         {"traced_busy_seconds", traced_busy},
         {"simulated_busy_seconds", busy},
         {"bubble_seconds", bubble},
         {"simulated_bubble_seconds", sim.bubble},
         {"nominal_bubble_seconds", nominal},
         {"simulated_peak_live_micro_batches_per_lane", peak},
         {"lane_peak_kib", most(lane_kib)},
         {"lane_peaks_kib", lane_kib}});
  }
  add_ratios_to_1f1b(
      rows,
      {{"bubble_seconds", "bubble_over_1f1b"},
       {"nominal_bubble_seconds", "nominal_bubble_over_1f1b"},
       {"lane_peak_kib", "lane_memory_over_1f1b"}});
  for (auto& row : rows) {
    auto ms = [&](const char* key) { return row[key].get<double>() * 1e3; };
    std::printf(
        "%-14s %8.1f %8.1f %6.3f %8.1f %8.1f %8.1f %8.1f %8.1f %8.3f %8.3f "
        "%5lld %8.0f %8.3f\n",
        row["schedule"].get<std::string>().c_str(),
        ms("step_seconds"),
        ms("simulated_seconds"),
        row["step_over_simulation"].get<double>(),
        ms("traced_busy_seconds"),
        ms("simulated_busy_seconds"),
        ms("bubble_seconds"),
        ms("simulated_bubble_seconds"),
        ms("nominal_bubble_seconds"),
        row["bubble_over_1f1b"].get<double>(),
        row["nominal_bubble_over_1f1b"].get<double>(),
        (long long)row["simulated_peak_live_micro_batches_per_lane"]
            .get<int64_t>(),
        row["lane_peak_kib"].get<double>(),
        row["lane_memory_over_1f1b"].get<double>());
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
      "lanes of 1 thread, %lld micro-batches, checkpoint never; peak: the "
      "whole step's, and the most one lane allocated above what it held "
      "before the step (activations and transients; parameters and "
      "gradients excluded)\n",
      (long long)lanes,
      (long long)m);
  std::printf(
      "%-14s %9s %10s %10s %10s %10s %10s\n",
      "schedule",
      "step_ms",
      "vs_1f1b",
      "peak_MiB",
      "vs_1f1b",
      "lane_MiB",
      "vs_1f1b");
  auto& counter = CountingAllocator::install();
  nlohmann::json rows = nlohmann::json::array();
  for (auto schedule : gpipe::schedules()) {
    const auto placement = gpipe::placement_for(schedule, lanes);
    const auto stages = placement.stages();
    const auto v = stages / lanes;
    const auto per_stage = static_cast<int64_t>(net->size()) / stages;
    // Each stage starts with a LaneTag of its lane, so that each lane's
    // allocations count apart; it copies the stage's input, so that what a
    // stage keeps of its input counts on its own lane. It ends with a
    // CopyGradient, so that the gradient coming back counts on the lane that
    // holds it too.
    torch::nn::Sequential tagged;
    for (int64_t j = 0; j < stages; ++j) {
      tagged->push_back(
          LaneTag(static_cast<int>(placement.lane_of(j)) + 1, true));
      for (int64_t k = 0; k < per_stage; ++k) {
        tagged->push_back(*(net->begin() + j * per_stage + k));
      }
      tagged->push_back(CopyGradient());
    }
    GPipe model(
        tagged,
        GPipeOptions(std::vector<int64_t>(stages, per_stage + 2))
            .chunks(m)
            .checkpoint(Checkpoint::Never)
            .placement(placement)
            .threads_per_lane(1));
    std::function<void()> step = [&] {
      model->zero_grad();
      model->train_step(x, t, mse, schedule);
    };
    const double seconds = time_median(step, 1, iters);
    const double memory = peak_mib(step);
    const auto lane_mib =
        scaled(lane_peak_bytes(counter, lanes, step), 1024.0 * 1024.0);
    rows.push_back(
        {{"schedule", to_string(schedule)},
         {"stages_per_lane", v},
         {"step_seconds", seconds},
         {"peak_mib", memory},
         {"lane_peak_mib", most(lane_mib)},
         {"lane_peaks_mib", lane_mib}});
  }
  add_ratios_to_1f1b(
      rows,
      {{"step_seconds", "time_over_1f1b"},
       {"peak_mib", "memory_over_1f1b"},
       {"lane_peak_mib", "lane_memory_over_1f1b"}});
  for (const auto& row : rows) {
    std::printf(
        "%-14s %9.1f %10.3f %10.1f %10.3f %10.1f %10.3f\n",
        row["schedule"].get<std::string>().c_str(),
        row["step_seconds"].get<double>() * 1e3,
        row["time_over_1f1b"].get<double>(),
        row["peak_mib"].get<double>(),
        row["memory_over_1f1b"].get<double>(),
        row["lane_peak_mib"].get<double>(),
        row["lane_memory_over_1f1b"].get<double>());
  }
  return rows;
}

}  // namespace

nlohmann::json schedules_section(int iters) {
  at::set_num_threads(1);
  return {{"fixed_cost", timed_table(iters)}, {"real", real_table(iters)}};
}

}  // namespace gpipe::bench
