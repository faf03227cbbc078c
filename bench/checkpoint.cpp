// gpipe-bench --only checkpoint: what a training checkpoint of the speed
// tables' U-Net costs per MiB to save (flushed to disk) and to load (every
// file checked against its checksum), against torch::save and torch::load
// of the same GPipe's weights alone (an archive, not flushed).

#include <gpipe/gpipe.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "checkpoint_io.h"
#include "harness.h"
#include "sections.h"
#include "unet_case.h"

namespace gpipe::bench {

namespace {

namespace fs = std::filesystem;

// Walks down by hand: LibTorch 2.x wheels carry broken copies of some of
// std::filesystem (Note [Removing a directory tree]).
int64_t bytes_under(const fs::path& dir) {
  int64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_directory()) {
      bytes += bytes_under(entry.path());
    } else if (entry.is_regular_file()) {
      bytes += static_cast<int64_t>(entry.file_size());
    }
  }
  return bytes;
}

}  // namespace

nlohmann::json checkpoint_section(int iters) {
  UNetSpeedCase unet;
  auto net = UNetSpeedCase::make();
  const auto layers = static_cast<int64_t>(net->size());
  const int64_t first = layers / 2;
  GPipe model(
      net,
      GPipeOptions({first, layers - first})
          .chunks(4)
          .devices({torch::kCPU, torch::kCPU}));
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  // One step, so that the optimizer has its moments to save.
  model->train_step(
      unet.x.narrow(0, 0, 8), unet.y.narrow(0, 0, 8), UNetSpeedCase::loss);
  optimizer.step();

  const auto root = fs::temp_directory_path() /
                    ("gpipe-bench-checkpoint-" + std::to_string(::getpid()));
  detail::remove_tree(root.string());
  // Removed however the section ends (a failed save left ~50 MB behind).
  struct Removed {
    std::string path;
    ~Removed() {
      detail::remove_tree(path);
    }
  } removed{root.string()};
  const auto archive = (root / "weights.pt").string();
  fs::create_directories(root);
  int64_t step = 0;
  TrainingState state;
  const double save = time_median(
      [&] {
        state.step = ++step;
        save_checkpoint((root / "ckpt").string(), model, optimizer, state);
      },
      1,
      iters);
  const double load = time_median(
      [&] { load_checkpoint((root / "ckpt").string(), model, optimizer); },
      1,
      iters);
  const double torch_save =
      time_median([&] { torch::save(model, archive); }, 1, iters);
  const double torch_load =
      time_median([&] { torch::load(model, archive); }, 1, iters);
  const auto checkpoint_bytes =
      bytes_under(latest_checkpoint((root / "ckpt").string()));
  const auto archive_bytes = static_cast<int64_t>(fs::file_size(archive));

  const double mib = checkpoint_bytes / 1048576.0;
  const double archive_mib = archive_bytes / 1048576.0;
  std::printf(
      "\n# training checkpoint of U-Net(%lld, %lld) with Adam's moments, 2 "
      "partitions\n",
      static_cast<long long>(UNetSpeedCase::B),
      static_cast<long long>(UNetSpeedCase::C));
  std::printf("%-40s %9s %10s %10s\n", "what", "MiB", "seconds", "ms/MiB");
  auto row = [](const char* what, double mib, double seconds) {
    std::printf(
        "%-40s %9.2f %10.4f %10.2f\n", what, mib, seconds, 1e3 * seconds / mib);
  };
  row("save_checkpoint (flushed)", mib, save);
  row("load_checkpoint (checksums checked)", mib, load);
  row("torch::save of the weights", archive_mib, torch_save);
  row("torch::load of the weights", archive_mib, torch_load);
  auto entry = [](const char* name, double mib, double seconds) {
    return nlohmann::json{
        {"name", name},
        {"mib", mib},
        {"seconds", seconds},
        {"ms_per_mib", 1e3 * seconds / mib}};
  };
  return nlohmann::json::array(
      {entry("save_checkpoint", mib, save),
       entry("load_checkpoint", mib, load),
       entry("torch::save", archive_mib, torch_save),
       entry("torch::load", archive_mib, torch_load)});
}

}  // namespace gpipe::bench
