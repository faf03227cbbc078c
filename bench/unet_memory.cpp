// gpipe-bench --only unet-memory: torchgpipe's memory table, scaled to a
// CPU. For a per-device budget, the largest U-Net(B, C) whose training
// step fits, each lane standing for one device.

#include <gpipe/gpipe.h>
#include <gpipe/models/unet.h>
#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "plot.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;

// VmHWM and VmRSS of this process, in MiB.
std::pair<double, double> rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  double hwm = 0;
  double rss = 0;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      hwm = std::stod(line.substr(6)) / 1024;
    } else if (line.rfind("VmRSS:", 0) == 0) {
      rss = std::stod(line.substr(6)) / 1024;
    }
  }
  return {hwm, rss};
}

// Starts a new peak RSS from the current one, after handing malloc's free
// pages back (lanes keep them; Note [Lanes and glibc's malloc]).
void reset_peak_rss() {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
}

struct MemoryConfig {
  std::string name;
  int64_t lanes;  // 0: the plain model
  Schedule schedule;
  Checkpoint checkpoint;
};

struct Fit {
  double device_mib = 0;   // the largest lane's parameters + peak
  double counted_mib = 0;  // every lane's, added up
  double rss_mib = 0;      // the step's peak RSS
  double seconds = 0;
};

double bytes_mib(double b) {
  return b / (1024.0 * 1024.0);
}

// One training step of U-Net(B, C) under `config`, after one warm-up step
// (so that the gradients exist, as in training): per-lane peaks.
Fit measure_unet(
    const MemoryConfig& config,
    int64_t B,
    int64_t C,
    const torch::Tensor& x,
    const torch::Tensor& y,
    int64_t chunks) {
  auto& counter = CountingAllocator::install();
  // What this thread holds before the model (the caller's, and other
  // sections' tensors) is none of the step's (Note [Device 0's share]).
  allocation_tag = 0;
  const double before = static_cast<double>(counter.tag_live(0));
  torch::manual_seed(0);
  auto net = models::unet(B, C, 3, 1, models::UNetOptions().dropout(0.0));
  std::vector<double> params;  // bytes per device
  std::function<void()> step;
  GPipe model{nullptr};
  if (config.lanes == 0) {
    params.push_back(0);
    for (const auto& p : net->parameters()) {
      params[0] += p.numel() * p.element_size();
    }
    step = [&] {
      net->zero_grad();
      mse(net->forward(x), y).backward();
    };
  } else {
    const auto balance =
        config.lanes == 1
            ? std::vector<int64_t>{static_cast<int64_t>(net->size())}
            : balance_by_size(config.lanes, net, x, chunks);
    torch::nn::Sequential tagged;
    std::vector<int64_t> tagged_balance;
    int64_t layer = 0;
    for (size_t k = 0; k < balance.size(); ++k) {
      tagged->push_back(LaneTag(static_cast<int>(k) + 1));
      params.push_back(0);
      for (int64_t j = 0; j < balance[k]; ++j, ++layer) {
        auto module = net->ptr(layer);
        tagged->push_back(*(net->begin() + layer));
        for (const auto& p : module->parameters()) {
          params[k] += p.numel() * p.element_size();
        }
      }
      tagged_balance.push_back(balance[k] + 1);
    }
    model = GPipe(
        tagged,
        GPipeOptions(tagged_balance)
            .chunks(chunks)
            .checkpoint(config.checkpoint)
            .threads_per_lane(1));
    step = [&] {
      model->zero_grad();
      model->train_step(x, y, mse, config.schedule);
    };
  }
  step();
  reset_peak_rss();
  counter.reset_tag_peaks();
  const auto start = std::chrono::steady_clock::now();
  step();
  Fit fit;
  fit.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  fit.rss_mib = rss_mib().first;
  // Note [Device 0's share]
  // This thread's allocations count on device 0: the batch, the loss, the
  // gathered output (and with no lanes, the whole step). The parameters
  // were made here too; they count on their lanes (params), so they come
  // off, with what was here before the model.
  double total_params = 0;
  for (const auto p : params) {
    total_params += p;
  }
  const double main = counter.tag_peak(0) - before - total_params +
                      static_cast<double>(x.nbytes() + y.nbytes());
  for (size_t k = 0; k < params.size(); ++k) {
    const double lane = params[k] +
                        (config.lanes == 0 ? 0.0 : counter.tag_peak(k + 1)) +
                        (k == 0 ? main : 0.0);
    fit.device_mib = std::max(fit.device_mib, bytes_mib(lane));
    fit.counted_mib += bytes_mib(lane);
  }
  return fit;
}

}  // namespace

json unet_memory_section(double budget_mib, const std::string& svg_dir) {
  at::set_num_threads(1);
  {
    // As in unet_speed_section: the same malloc for every row.
    auto net = models::unet(1, 8, 3, 1);
    GPipe first(net, GPipeOptions({static_cast<int64_t>(net->size())}));
  }
  const int64_t batch = 16;
  const int64_t chunks = 8;
  torch::manual_seed(0);
  auto x = torch::randn({batch, 3, 32, 32});
  auto y = torch::randn({batch, 1, 32, 32});
  // For each width C, the largest U-Net(B, C) whose step fits (memory
  // grows with B: B doubles, then bisects); the largest model is the one
  // of most parameters over all widths. The plot shows the steps measured
  // for kPlotted.
  const std::vector<int64_t> widths{8, 12, 16, 24, 32};
  const int64_t kPlotted = 16;
  const std::vector<MemoryConfig> configs{
      {"plain", 0, Schedule::FillDrain, Checkpoint::Never},
      {"gpipe 1 lane, checkpoint always",
       1,
       Schedule::FillDrain,
       Checkpoint::Always},
      {"gpipe 2 lanes, fill_drain",
       2,
       Schedule::FillDrain,
       Checkpoint::ExceptLast},
      {"gpipe 2 lanes, 1f1b", 2, Schedule::OneFOneB, Checkpoint::ExceptLast},
      {"gpipe 4 lanes, fill_drain",
       4,
       Schedule::FillDrain,
       Checkpoint::ExceptLast},
      {"gpipe 4 lanes, 1f1b", 4, Schedule::OneFOneB, Checkpoint::ExceptLast}};
  std::printf(
      "\n# unet-memory: the largest U-Net(B, C) whose training step fits "
      "%.0f MiB per device (a lane), batch %lld of 3x32x32, chunks %lld, "
      "dropout 0, no optimizer state\n",
      budget_mib,
      (long long)batch,
      (long long)chunks);
  std::printf(
      "%-34s %10s %10s %12s %12s %10s\n",
      "config",
      "U-Net(B,C)",
      "params_M",
      "device_MiB",
      "counted_MiB",
      "rss_MiB");
  json rows = json::array();
  std::vector<Series> series;
  for (size_t c = 0; c < configs.size(); ++c) {
    const auto& config = configs[c];
    Series line;
    line.label = config.name;
    json best;
    for (const int64_t C : widths) {
      // Whether U-Net(B, C) fits; the best so far and the plot's points
      // follow.
      auto fits = [&](int64_t B) {
        const double params = models::unet_parameter_count(B, C, 3, 1) / 1e6;
        const auto fit = measure_unet(config, B, C, x, y, chunks);
        if (C == kPlotted) {
          line.points.emplace_back(params, fit.device_mib);
        }
        if (fit.device_mib > budget_mib) {
          return false;
        }
        if (best.is_null() ||
            params > best["parameters_millions"].get<double>()) {
          best = {
              {"config", config.name},
              {"B", B},
              {"C", C},
              {"parameters_millions", params},
              {"device_peak_mib", fit.device_mib},
              {"counted_total_mib", fit.counted_mib},
              {"peak_rss_mib", fit.rss_mib},
              {"step_seconds", fit.seconds}};
        }
        return true;
      };
      // Memory grows with B: B doubles until a step no longer fits, then
      // the largest that fits is found between (a step of a large model
      // takes seconds, and B = 1, 2, 3, ... took many).
      int64_t fitting = 0;
      int64_t over = 1;
      while (fits(over)) {
        fitting = over;
        over *= 2;
      }
      while (over - fitting > 1) {
        const int64_t mid = fitting + (over - fitting) / 2;
        if (fits(mid)) {
          fitting = mid;
        } else {
          over = mid;
        }
      }
    }
    std::sort(line.points.begin(), line.points.end());
    if (best.is_null()) {
      std::printf("%-34s none fits\n", config.name.c_str());
      rows.push_back({{"config", config.name}, {"fits", "none"}});
    } else {
      std::printf(
          "%-34s %10s %10.2f %12.1f %12.1f %10.1f\n",
          config.name.c_str(),
          ("(" + std::to_string(best["B"].get<int64_t>()) + ", " +
           std::to_string(best["C"].get<int64_t>()) + ")")
              .c_str(),
          best["parameters_millions"].get<double>(),
          best["device_peak_mib"].get<double>(),
          best["counted_total_mib"].get<double>(),
          best["peak_rss_mib"].get<double>());
      rows.push_back(best);
    }
    std::fflush(stdout);
    series.push_back(line);
  }
  if (!svg_dir.empty()) {
    Series budget;
    budget.label = "budget per device";
    budget.stroke = Series::Stroke::Dashed;
    budget.markers = false;
    budget.color = 6;
    double most = 0;
    for (const auto& s : series) {
      for (const auto& point : s.points) {
        most = std::max(most, point.first);
      }
    }
    budget.points = {{0, budget_mib}, {most, budget_mib}};
    series.push_back(budget);
    write_line_plot(
        svg_dir + "/unet-memory.svg",
        {"U-Net(B, " + std::to_string(kPlotted) +
             "), B doubled, then bisected: peak memory of the fullest "
             "device in a training step",
         "parameters (millions)",
         "MiB on the fullest device",
         /*log_x=*/false},
        series);
  }
  return {
      {"budget_mib_per_device", budget_mib},
      {"batch", batch},
      {"chunks", chunks},
      {"rows", rows}};
}

}  // namespace gpipe::bench
