// gpipe-bench --only unet-speed: torchgpipe's speed table, scaled to a
// CPU. A U-Net's training step through 1, 2 and 4 lanes at 1, 4 and 32
// micro-batches under each schedule, against the plain model.

#include <gpipe/gpipe.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "harness.h"
#include "plot.h"
#include "sections.h"
#include "unet_case.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;

// One training step of GPipe through train_step.
double gpipe_step_seconds(
    GPipe& model,
    const torch::Tensor& x,
    const torch::Tensor& y,
    Schedule schedule,
    int iters) {
  return time_median(
      [&] {
        model->zero_grad();
        model->train_step(x, y, mse, schedule);
      },
      1,
      iters);
}

struct SpeedCase {
  int64_t lanes;
  int64_t stages_per_lane;
  Schedule schedule;
};

}  // namespace

json unet_speed_section(int iters, const std::string& svg_dir) {
  const UNetSpeedCase unet;
  const int64_t B = UNetSpeedCase::B;
  const int64_t C = UNetSpeedCase::C;
  const int64_t batch = UNetSpeedCase::batch;
  const int64_t image = UNetSpeedCase::image;
  const auto& x = unet.x;
  const auto& y = unet.y;
  const auto make = &UNetSpeedCase::make;
  std::printf(
      "\n# unet-speed: U-Net(%lld, %lld), %lld layers, %.2f M parameters, "
      "batch %lld of 3x%lldx%lld, training step (mse), checkpoint "
      "except_last, one thread per lane\n",
      (long long)B,
      (long long)C,
      (long long)make()->size(),
      models::unet_parameter_count(B, C, 3, 1) / 1e6,
      (long long)batch,
      (long long)image,
      (long long)image);
  auto plain = make();
  std::map<int, double> plain_s;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    plain_s[threads] = time_median(
        [&] {
          plain->zero_grad();
          mse(plain->forward(x), y).backward();
        },
        1,
        iters);
  }
  at::set_num_threads(1);
  std::printf(
      "plain: %.1f ms on 1 thread, %.1f ms on 2\n",
      plain_s[1] * 1e3,
      plain_s[2] * 1e3);
  std::printf(
      "%-12s %5s %4s %6s %9s %9s %9s %7s\n",
      "schedule",
      "lanes",
      "v",
      "chunks",
      "step_ms",
      "vs_plain1",
      "vs_plain2",
      "bound");
  std::vector<SpeedCase> cases{{1, 1, Schedule::FillDrain}};
  for (int64_t n : {2, 4}) {
    cases.push_back({n, 1, Schedule::FillDrain});
    cases.push_back({n, 1, Schedule::OneFOneB});
    cases.push_back({n, 2, Schedule::Interleaved1F1B});
    cases.push_back({n, 1, Schedule::ZeroBubble});
  }
  json rows = json::array();
  std::map<std::string, Series> lines;
  for (const auto& c : cases) {
    auto net = make();
    const auto stages = c.lanes * c.stages_per_lane;
    const auto balance =
        stages == 1
            ? std::vector<int64_t>{static_cast<int64_t>(net->size())}
            : balance_by_time(stages, net, x.narrow(0, 0, batch / 4), 0.3);
    for (int64_t m : {1, 4, 32}) {
      std::string refused;
      double s = 0;
      GPipe model{nullptr};
      try {
        model = GPipe(
            net,
            GPipeOptions(balance)
                .chunks(m)
                .stages_per_lane(c.stages_per_lane)
                .checkpoint(Checkpoint::ExceptLast)
                .threads_per_lane(1));
        s = gpipe_step_seconds(model, x, y, c.schedule, iters);
      } catch (const c10::Error& e) {
        refused = e.what_without_backtrace();
        refused = refused.substr(0, refused.find('\n'));
      }
      // One step's timeline of each (outside the try: a file that cannot
      // be written is no refused configuration).
      if (refused.empty() && c.lanes == 4 && m == 4 && c.stages_per_lane == 1 &&
          (c.schedule == Schedule::FillDrain ||
           c.schedule == Schedule::OneFOneB) &&
          !svg_dir.empty()) {
        auto trace = std::make_shared<Trace>();
        model->set_trace(trace);
        model->zero_grad();
        model->train_step(x, y, mse, c.schedule);
        model->set_trace(nullptr);
        trace->write_svg(
            svg_dir + "/unet-timeline-" + to_string(c.schedule) + ".svg");
      }
      const double bound =
          double(c.lanes) * m / (m + c.lanes - 1);  // fill-drain's
      const auto name = to_string(c.schedule);
      if (!refused.empty()) {
        std::printf(
            "%-12s %5lld %4lld %6lld refused: %s\n",
            name.c_str(),
            (long long)c.lanes,
            (long long)c.stages_per_lane,
            (long long)m,
            refused.c_str());
        rows.push_back(
            {{"schedule", name},
             {"lanes", c.lanes},
             {"stages_per_lane", c.stages_per_lane},
             {"chunks", m},
             {"refused", refused}});
        continue;
      }
      std::printf(
          "%-12s %5lld %4lld %6lld %9.1f %9.3f %9.3f %7.3f\n",
          name.c_str(),
          (long long)c.lanes,
          (long long)c.stages_per_lane,
          (long long)m,
          s * 1e3,
          plain_s[1] / s,
          plain_s[2] / s,
          bound);
      rows.push_back(
          {{"schedule", name},
           {"lanes", c.lanes},
           {"stages_per_lane", c.stages_per_lane},
           {"chunks", m},
           {"step_ms", s * 1e3},
           {"samples_per_second", batch / s},
           {"speedup_vs_plain_1t", plain_s[1] / s},
           {"speedup_vs_plain_2t", plain_s[2] / s},
           {"fill_drain_bound", bound}});
      auto key = std::to_string(c.lanes) + " lanes, " + name;
      if (c.lanes == 1) {
        key = "1 lane";
      }
      auto& line = lines[key];
      line.label = key;
      line.points.emplace_back(double(m), plain_s[1] / s);
    }
  }
  if (!svg_dir.empty()) {
    std::vector<Series> series;
    int colour = 0;
    for (const auto& key :
         {"1 lane",
          "2 lanes, fill_drain",
          "2 lanes, 1f1b",
          "4 lanes, fill_drain",
          "4 lanes, 1f1b",
          "4 lanes, interleaved",
          "4 lanes, zero_bubble"}) {
      if (lines.count(key)) {
        lines[key].color = colour;
        series.push_back(lines[key]);
      }
      ++colour;
    }
    for (int64_t n : {2, 4}) {
      Series bound;
      bound.label = "bound, " + std::to_string(n) + " devices";
      bound.stroke = Series::Stroke::Dotted;
      bound.markers = false;
      bound.color = n == 2 ? 1 : 3;
      for (double m = 1; m <= 32; m *= 2) {
        bound.points.emplace_back(m, n * m / (m + n - 1));
      }
      series.push_back(bound);
    }
    Series cores;
    cores.label = "this machine's 2 cores";
    cores.stroke = Series::Stroke::Dashed;
    cores.markers = false;
    cores.color = 6;
    cores.points = {{1, 2}, {32, 2}};
    series.push_back(cores);
    write_line_plot(
        svg_dir + "/unet-speedup.svg",
        {"U-Net(2, 16) training step: speed-up over the plain model (1 thread)",
         "micro-batches (chunks)",
         "speed-up",
         /*log_x=*/true},
        series);
  }
  return {
      {"model", UNetSpeedCase::model_json()},
      {"plain_ms_1t", plain_s[1] * 1e3},
      {"plain_ms_2t", plain_s[2] * 1e3},
      {"rows", rows}};
}

}  // namespace gpipe::bench
