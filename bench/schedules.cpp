// gpipe-bench's schedules section: FillDrain against OneFOneB through
// train_step, checkpoint never, on 2 and 4 lanes of one thread each (4 lanes
// share the 2 cores): step time timed in alternation, and peak memory.

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

nlohmann::json schedules_section(int iters) {
  using gpipe::Checkpoint;
  using nlohmann::json;
  at::set_num_threads(1);
  auto wide = mlp(16, 256);
  auto xw = torch::randn({4096, 256});
  auto target = torch::zeros({4096, 256});
  auto loss_fn = [](torch::Tensor y, torch::Tensor t) {
    return torch::mse_loss(y, t);
  };
  json schedules = json::array();
  std::printf(
      "\n# schedules: 16 x (Linear(256,256)+ReLU), batch 4096, train_step, "
      "checkpoint never\n");
  std::printf(
      "%2s %6s %12s %12s %12s %12s %10s %10s\n",
      "n",
      "chunks",
      "fd_step_ms",
      "1f1b_step_ms",
      "fd_peak_MiB",
      "1f1b_peak_MiB",
      "time_ratio",
      "mem_ratio");
  for (int64_t n : {2, 4}) {
    for (int64_t chunks : {4, 8, 16, 32}) {
      std::vector<int64_t> balance(n, 32 / n);
      gpipe::GPipe model(
          wide,
          gpipe::GPipeOptions(balance)
              .chunks(chunks)
              .checkpoint(Checkpoint::Never)
              .threads_per_lane(1));
      auto step_of = [&](gpipe::Schedule schedule) {
        return std::function<void()>([&model, &xw, &target, loss_fn, schedule] {
          model->zero_grad();
          model->train_step(xw, target, loss_fn, schedule);
        });
      };
      auto fd = step_of(gpipe::Schedule::FillDrain);
      auto ofob = step_of(gpipe::Schedule::OneFOneB);
      const auto [t_fd, t_1f1b] = gpipe::bench::time_paired(fd, ofob, 1, iters);
      const double m_fd = peak_mib(fd);
      const double m_1f1b = peak_mib(ofob);
      std::printf(
          "%2lld %6lld %12.1f %12.1f %12.1f %12.1f %10.3f %10.3f\n",
          (long long)n,
          (long long)chunks,
          t_fd * 1e3,
          t_1f1b * 1e3,
          m_fd,
          m_1f1b,
          t_1f1b / t_fd,
          m_1f1b / m_fd);
      schedules.push_back(
          {{"partitions", n},
           {"chunks", chunks},
           {"fill_drain_step_seconds", t_fd},
           {"one_f_one_b_step_seconds", t_1f1b},
           {"fill_drain_peak_mib", m_fd},
           {"one_f_one_b_peak_mib", m_1f1b},
           {"time_ratio", t_1f1b / t_fd},
           {"memory_ratio", m_1f1b / m_fd}});
    }
  }
  return schedules;
}

}  // namespace gpipe::bench
