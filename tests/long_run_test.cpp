// A long run through the public API: thousands of small steps mixing every
// path of the engine (forward + loss.backward(), train_step under both
// schedules, eval forward, tracing switched on and off, DeferredBatchNorm,
// Dropout, every checkpoint mode), checking that resident memory stays
// flat. A leak of a few KB per step (a cell, a tensor, an autograd node or a
// trace event kept alive) shows up as megabytes over the run.
//
// GPIPE_LONG_RUN_STEPS overrides the number of steps (scripts/sanitize.sh
// shortens the run). Under AddressSanitizer or ThreadSanitizer the steps
// still run, but resident memory is not checked: their shadow memory and
// quarantine of freed blocks make it grow by design (LeakSanitizer checks
// leaks there instead).

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "common.h"
#include "sanitized.h"

namespace gpipe {
namespace {

using testing::SeededTest;

constexpr int64_t kDefaultSteps = 3000;
constexpr int64_t kWarmUpSteps = 300;
constexpr int64_t kTraceToggleSteps = 100;  // on for 100 steps, off for 100
// 8 MiB over the 2700 steps after warm-up: a leak of 3 KB per step fails.
constexpr int64_t kMaxGrowthBytes = int64_t{8} << 20;

int64_t steps_from_env() {
  const char* value = std::getenv("GPIPE_LONG_RUN_STEPS");
  return value != nullptr ? std::atoll(value) : kDefaultSteps;
}

// Resident set size in bytes (the second field of /proc/self/statm, in
// pages). Memory freed to malloc is given back to the system first, so the
// number follows live memory rather than the allocator's free lists.
int64_t resident_bytes() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0;
  int64_t resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// 9 layers, two BatchNorms (deferred by the option) and two Dropouts.
torch::nn::Sequential small_model() {
  return torch::nn::Sequential(
      torch::nn::Linear(16, 32),
      torch::nn::BatchNorm1d(32),
      torch::nn::ReLU(),
      torch::nn::Dropout(0.1),
      torch::nn::Linear(32, 32),
      torch::nn::BatchNorm1d(32),
      torch::nn::Tanh(),
      torch::nn::Dropout(0.1),
      torch::nn::Linear(32, 4));
}

class LongRunTest : public SeededTest {};

TEST_F(LongRunTest, ResidentMemoryStaysFlatOverThousandsOfSteps) {
  const int64_t steps = steps_from_env();
  ASSERT_GT(steps, 0) << "GPIPE_LONG_RUN_STEPS must be positive";

  // One model per checkpoint mode (the mode is fixed at construction).
  const std::array<Checkpoint, 3> modes = {
      Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never};
  std::vector<GPipe> models;
  std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
  for (Checkpoint mode : modes) {
    models.emplace_back(
        small_model(),
        GPipeOptions({4, 5})
            .chunks(4)
            .checkpoint(mode)
            .deferred_batch_norm(true)
            .threads_per_lane(1));
    optimizers.push_back(std::make_unique<torch::optim::SGD>(
        models.back()->parameters(), /*lr=*/0.01));
  }
  auto loss_fn = [](torch::Tensor y, torch::Tensor t) {
    return torch::nn::functional::cross_entropy(y, t);
  };

  std::shared_ptr<Trace> trace;
  int64_t traces = 0;
  std::chrono::steady_clock::duration longest_hold{0};
  int64_t rss_after_warm_up = 0;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == kWarmUpSteps) {
      rss_after_warm_up = resident_bytes();
    }
    // Tracing on for one stretch of steps, off for the next: a fresh Trace
    // each time, dropped when switched off, so only the engine could keep
    // events alive.
    const bool tracing = (step / kTraceToggleSteps) % 2 == 1;
    if (tracing && trace == nullptr) {
      trace = std::make_shared<Trace>();
      for (auto& model : models) {
        model->set_trace(trace);
      }
    } else if (!tracing && trace != nullptr) {
      for (auto& model : models) {
        model->set_trace(nullptr);
      }
      ASSERT_FALSE(trace->events().empty()) << "step " << step;
      std::weak_ptr<Trace> dropped = trace;
      trace.reset();
      // A lane drops its task (and the pass's state, which holds the trace)
      // just after the caller has returned: allow it a moment.
      const auto dropped_at = std::chrono::steady_clock::now();
      const auto deadline = dropped_at + std::chrono::seconds(10);
      while (!dropped.expired() &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ASSERT_TRUE(dropped.expired())
          << "the engine still holds a trace switched off at step " << step;
      longest_hold =
          std::max(longest_hold, std::chrono::steady_clock::now() - dropped_at);
      ++traces;
    }

    // Models in turn; each model goes through the four kinds of step in turn
    // (3 and 4 are coprime).
    auto& model = models[step % 3];
    auto& optimizer = *optimizers[step % 3];
    auto x = torch::randn({16, 16});
    auto y = torch::randint(0, 4, {16}, torch::kLong);
    optimizer.zero_grad();
    torch::Tensor loss;
    switch ((step / 3) % 4) {
      case 0:
        loss = loss_fn(model->forward(x), y);
        loss.backward();
        break;
      case 1:
        loss = model->train_step(x, y, loss_fn, Schedule::FillDrain);
        break;
      case 2:
        loss = model->train_step(x, y, loss_fn, Schedule::OneFOneB);
        break;
      default: {
        model->eval();
        torch::NoGradGuard no_grad;
        loss = loss_fn(model->forward(x), y);
        model->train();
        break;
      }
    }
    ASSERT_TRUE(std::isfinite(loss.item<float>())) << "step " << step;
    optimizer.step();
  }
  const int64_t rss_at_end = resident_bytes();
  if (steps > 2 * kTraceToggleSteps) {
    EXPECT_GT(traces, 0);
  }
  std::printf(
      "%lld traces switched off; the engine let go of each within %.3f ms\n",
      static_cast<long long>(traces),
      std::chrono::duration<double, std::milli>(longest_hold).count());

  if (steps <= kWarmUpSteps) {
    // Skipped: a slow machine: the time budget allowed too few steps
    GTEST_SKIP()  // a slow machine: the time budget allowed too few steps
        << steps << " steps: too few to measure memory after a " << kWarmUpSteps
        << "-step warm-up";
  }
  const int64_t growth = rss_at_end - rss_after_warm_up;
  std::printf(
      "%lld steps; resident memory after %lld warm-up steps: %.2f MiB, at the "
      "end: %.2f MiB, growth %.1f KiB (%.3f KiB per step)\n",
      static_cast<long long>(steps),
      static_cast<long long>(kWarmUpSteps),
      rss_after_warm_up / 1048576.0,
      rss_at_end / 1048576.0,
      growth / 1024.0,
      growth / 1024.0 / static_cast<double>(steps - kWarmUpSteps));
#ifdef GPIPE_SANITIZED
  // Skipped: sanitizer builds only: shadow memory grows by design
  GTEST_SKIP()  // sanitizer builds only: shadow memory grows by design
      << "resident memory is not checked under a sanitizer (shadow "
         "memory and quarantine grow by design)";
#else
  EXPECT_LT(growth, kMaxGrowthBytes)
      << "resident memory grew by " << growth << " bytes over "
      << steps - kWarmUpSteps << " steps";
#endif
}

}  // namespace
}  // namespace gpipe
