#pragma once

// The planner: from a model and a sample batch to a balance, a number of
// micro-batches, a schedule, a placement and a checkpoint mode that fit a
// memory limit per lane, chosen by simulating every candidate with costs
// measured on the model.
//
// ```
// auto tuned = gpipe::autotune(net, sample_input, sample_target, loss_fn,
//     gpipe::AutotuneOptions(/*lanes=*/4).memory_limit(256 << 20)
//         .batch_size(64));
// std::cout << tuned;           // the choice; tuned.report(): every candidate
// gpipe::GPipe model(net, tuned.options());
// model->train_step(x, y, loss_fn, tuned.plan);
// ```

#include <gpipe/options.h>
#include <gpipe/placement.h>
#include <gpipe/plan.h>
#include <gpipe/schedule.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace gpipe {

/// What `autotune` searches and the limit it keeps to.
struct AutotuneOptions {
  /* implicit */ AutotuneOptions(int64_t lanes) : lanes_(lanes) {}

  /// Lanes (devices, or CPU threads) the pipeline runs on.
  TORCH_ARG(int64_t, lanes);
  /// The most bytes one lane may hold at its peak: its partitions'
  /// parameters times `param_scale` and the activations its schedule keeps.
  /// 0: no limit.
  TORCH_ARG(int64_t, memory_limit) = 0;
  /// Rows of the mini-batch each step trains on; 0: the sample's.
  TORCH_ARG(int64_t, batch_size) = 0;
  /// The schedules tried (every one by default), each on
  /// `placement_for(schedule, lanes)`: interleaved and looped BFS run 2
  /// partitions per lane (modulo), ZB-V 2 in a V, the others 1.
  TORCH_ARG(std::vector<Schedule>, schedules) = gpipe::schedules();
  /// The micro-batch counts tried (those above the batch size are skipped).
  TORCH_ARG(std::vector<int64_t>, chunks) = {1, 2, 4, 8, 16, 32};
  /// The checkpoint modes tried.
  TORCH_ARG(std::vector<Checkpoint>, checkpoints) = {
      Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always};
  /// Bytes held per byte of trainable parameters: the value, its gradient
  /// and the optimizer's state (2 for plain SGD, 3 with momentum, 4 for
  /// Adam). A frozen parameter (no requires_grad) holds its value alone.
  TORCH_ARG(double, param_scale) = 2.0;
  /// Seconds of profiling per micro-batch size (at least one pass each).
  TORCH_ARG(double, profile_seconds) = 0.25;
  /// What running one cell costs beyond its layers (the engine's own work
  /// per forward or backward action).
  TORCH_ARG(double, cell_overhead_seconds) = 50e-6;
  /// Intra-op threads each CPU lane profiles and runs with. 0 (as GPipe's
  /// default): max(1, cores / lanes), and the lanes of one process share
  /// the cores by the plan, so a plan whose lanes never work at once runs
  /// every cell on all of them; the search then weighs such plans both
  /// ways and chooses (`Autotuned::threads_per_lane`). Cores are
  /// OMP_NUM_THREADS when set, else the hardware's threads.
  TORCH_ARG(int64_t, threads_per_lane) = 0;
};

/// One configuration `autotune` simulated.
struct AutotuneCandidate {
  std::vector<int64_t> balance;
  int64_t chunks = 1;
  Schedule schedule = Schedule::FillDrain;
  Placement placement;
  Checkpoint checkpoint = Checkpoint::ExceptLast;
  /// GPipeOptions::threads_per_lane it was simulated with: 0, the lanes
  /// share the cores by the plan; else that count on every lane.
  int64_t threads_per_lane = 0;
  double predicted_step_seconds = 0;
  /// Per lane: the most bytes it holds (parameters and activations).
  std::vector<double> predicted_peak_bytes;
  /// Empty when it fits the limit; else why it was rejected.
  std::string rejected;
};

/// What `autotune` chose, with every candidate it weighed.
struct Autotuned {
  std::vector<int64_t> balance;
  int64_t chunks = 1;
  Schedule schedule = Schedule::FillDrain;
  Placement placement;
  Checkpoint checkpoint = Checkpoint::ExceptLast;
  /// The step's plan (`model->train_step(x, y, loss_fn, tuned.plan)` runs
  /// exactly what was simulated; the schedule gives the same plan).
  Plan plan;
  double predicted_step_seconds = 0;
  /// Per lane.
  std::vector<double> predicted_peak_bytes;
  /// GPipeOptions::threads_per_lane of the choice: 0 (the lanes share the
  /// cores by the plan, GPipe's default), or a count fixed on every lane
  /// where the simulation found that faster (or it was given).
  int64_t threads_per_lane = 0;
  /// Every candidate, fastest first (to the microsecond; of two as fast,
  /// the one whose most loaded lane holds less), the rejected ones with
  /// their reason.
  std::vector<AutotuneCandidate> candidates;

  /// GPipeOptions of the choice: balance, chunks, checkpoint, placement,
  /// threads_per_lane.
  GPipeOptions options() const;
  /// A table of the candidates: the choice, the fastest ones that fit, and
  /// the fastest rejected ones with why.
  std::string report(size_t rows = 12) const;
};

/// "balance [..], chunks 8, schedule 1f1b on modulo(..), checkpoint never,
/// threads per lane plan: predicted 12.3 ms per step, peak 200.0 MiB on the
/// most loaded lane".
std::ostream& operator<<(std::ostream& out, const Autotuned& tuned);

/// Profiles each layer of `net` on copies (forward, input-gradient and
/// weight-gradient times at each micro-batch size tried, activation and
/// parameter bytes, the loss's time), searches balances (by time, by
/// memory and between them) x schedules x micro-batch counts x checkpoint
/// modes, simulates each with those costs and a memory model (what each
/// stage keeps per live micro-batch, from the simulated timeline), and
/// returns the fastest whose most loaded lane fits `memory_limit`.
/// `sample_input` and `sample_target` are a mini-batch (or rows of one);
/// its rows are cut as `batch_size` rows would be. A micro-batch count
/// whose micro-batches cannot be profiled (larger than the sample, or
/// refused by a layer: BatchNorm in training on one row) is rejected with
/// why (`report()`). `net` is not changed.
///
/// Throws `c10::ValueError` when the options are out of range (lanes below
/// 1 or above the layers, a negative limit, batch size or profiling time,
/// no schedule or chunks to try, a sample smaller than the smallest
/// micro-batch), when no candidate fits the limit (naming the smallest peak
/// found), and the first profiling error when no micro-batch count runs.
Autotuned autotune(
    torch::nn::Sequential net,
    torch::Tensor sample_input,
    torch::Tensor sample_target,
    const LossFunction& loss_fn,
    const AutotuneOptions& options);

}  // namespace gpipe
