// gpipe-train's --devices: the device of each lane, checked before anything
// is built; by default one CUDA device per lane when the machine has enough
// of them, else the CPU (so a machine with one GPU still runs the default
// two partitions).

#include <c10/util/Exception.h>
#include <gpipe/verify.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include "train_args.h"

namespace gpipe_train {

void add_devices_option(CLI::App& app, Args& args) {
  app.add_option(
      "--devices",
      args.devices_text,
      "Device of each lane, e.g. cpu,cpu or cuda:0,cuda:1 (default: one "
      "CUDA device per lane when there are enough, else the CPU)");
}

void verify_devices_option(const CLI::App& app, Args& args) {
  const auto lanes = args.partitions / args.stages_per_lane;
  args.devices.clear();
  if (app.count("--devices") == 0) {
    const auto cuda = static_cast<int64_t>(torch::cuda::device_count());
    for (int64_t l = 0; l < lanes; ++l) {
      args.devices.push_back(
          cuda >= lanes
              ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(l))
              : torch::Device(torch::kCPU));
    }
    return;
  }
  usage_check(
      args.world_size == 1,
      "--devices is for one process; under a launcher each rank runs on the "
      "CPU, or on cuda:<LOCAL_RANK> when built with CUDA");
  const auto& text = args.devices_text;
  size_t begin = 0;
  for (;;) {
    const auto end = std::min(text.find(',', begin), text.size());
    const auto item = text.substr(begin, end - begin);
    try {
      args.devices.emplace_back(item);
    } catch (const c10::Error&) {
      throw UsageError(c10::str(
          "--devices '",
          text,
          "': entry ",
          args.devices.size() + 1,
          " ('",
          item,
          "') is not a device; expected cpu or cuda:N"));
    }
    if (end == text.size()) {
      break;
    }
    begin = end + 1;
  }
  usage_check(
      static_cast<int64_t>(args.devices.size()) == lanes,
      "--devices '",
      text,
      "' names ",
      count_of(static_cast<int64_t>(args.devices.size()), "device", "devices"),
      ", but the pipeline has ",
      count_of(lanes, "lane", "lanes"),
      " (partitions / stages per lane); give one per lane");
  // The library's own rule (a CUDA device this LibTorch cannot reach),
  // before anything is built.
  try {
    gpipe::verify_devices(args.devices, lanes);
  } catch (const c10::Error& e) {
    throw UsageError(
        c10::str("--devices '", text, "': ", e.what_without_backtrace()));
  }
}

}  // namespace gpipe_train
