// gpipe-bench --only overhead: what the engine costs per cell, on layers
// so small that their own work hardly shows.

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

// Scheduling overhead: 32 tiny layers, chunks 32, against the plain model
// running the same micro-batches one after the other.
nlohmann::json overhead_section() {
  using nlohmann::json;
  at::set_num_threads(1);
  auto tiny = mlp(16, 64);
  const int64_t chunks = 32;
  auto xt = torch::randn({chunks * 4, 64});
  auto pieces = xt.chunk(chunks);
  auto plain_step = [&] {
    tiny->zero_grad();
    for (const auto& p : pieces) {
      tiny->forward(p).pow(2).mean().backward();
    }
  };
  json overhead = json::array();
  std::printf(
      "\n# per-cell overhead: 16 x (Linear(64,64)+ReLU) = 32 layers, chunks "
      "32, checkpoint never\n");
  std::printf(
      "%3s %8s %12s %12s %14s\n",
      "n",
      "cells",
      "plain_ms",
      "gpipe_ms",
      "us_per_cell");
  for (int64_t n : {1, 2}) {
    gpipe::GPipe model(
        tiny,
        gpipe::GPipeOptions(
            n == 1 ? std::vector<int64_t>{32} : std::vector<int64_t>{16, 16})
            .chunks(chunks)
            .checkpoint(Checkpoint::Never)
            .threads_per_lane(1));
    auto step = [&model, &xt] {
      model->zero_grad();
      model->forward(xt).pow(2).mean().backward();
    };
    const auto [t_plain, t] =
        gpipe::bench::time_paired(plain_step, step, 5, 101);
    const int64_t cells = 2 * chunks * n;
    // One lane does all the plain model's work plus the engine's: the
    // difference per cell is the overhead. With two lanes the work is
    // split, so that row shows wall time only.
    const double per_cell = n == 1 ? (t - t_plain) / cells * 1e6 : 0.0;
    std::printf(
        "%3lld %8lld %12.3f %12.3f %14.2f\n",
        (long long)n,
        (long long)cells,
        t_plain * 1e3,
        t * 1e3,
        per_cell);
    overhead.push_back(
        {{"partitions", n},
         {"cells", cells},
         {"plain_seconds", t_plain},
         {"gpipe_seconds", t},
         {"overhead_us_per_cell", per_cell}});
  }
  return overhead;
}

}  // namespace gpipe::bench
