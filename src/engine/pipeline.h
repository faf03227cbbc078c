#pragma once

// The pipeline: stages, their lanes, and the three passes GPipe runs over
// them (forward, train, and through the autograd node, backward), each a
// plan run by the plan runner. Passes of one pipeline are serialised.

#include <gpipe/microbatch.h>
#include <gpipe/options.h>
#include <gpipe/placement.h>
#include <gpipe/schedule.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/endpoints.h"
#include "engine/lane.h"
#include "engine/runner.h"
#include "engine/stage.h"
#include "engine/transport.h"
#include "packet.h"
#include "skip.h"

namespace gpipe {
class Trace;
}  // namespace gpipe

namespace gpipe::detail {

class Pipeline : public std::enable_shared_from_this<Pipeline> {
 public:
  /// Partition j on lane `placement.lane_of(j)` (empty: lane j), on
  /// `devices[j]` (a lane runs on its first partition's device); CPU lanes
  /// get `threads_per_lane` intra-op threads. With `local` given, only the
  /// partitions it marks run here (stages in other processes: src/dist/);
  /// lanes holding none of them are not made, their cells are another
  /// process's, and their layers stay where they are.
  Pipeline(
      std::vector<torch::nn::Sequential> partitions,
      std::vector<torch::Device> devices,
      int64_t threads_per_lane,
      std::vector<bool> local = {},
      Placement placement = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Runs `inputs` (already scattered) through every stage and returns the
  /// last stage's outputs gathered into one packet. When a graph is built
  /// the returned tensors that require grad are connected to autograd:
  /// their backward runs the pipelined backward, and gradients reach
  /// `original_inputs` and the parameters.
  Packet forward(
      std::vector<Packet> inputs,
      const Batch& original_inputs,
      const PassOptions& options);

  /// A training step in one pass: every micro-batch's forward, its loss
  /// (`loss_fn(output, target)` times its share of the batch) on the last
  /// stage, and backward, in the order `plan` gives. Gradients accumulate
  /// into `.grad` (and flow into inputs that require grad). Returns the
  /// batch's loss, detached.
  torch::Tensor train(
      std::vector<Packet> inputs,
      std::vector<torch::Tensor> targets,
      const Batch& original_inputs,
      const LossFunction& loss_fn,
      const Plan& plan,
      const PassOptions& options);

  /// What a forward pass leaves: the pass (its cells, for a backward), the
  /// last stage's outputs where it is here, and the rows of each
  /// micro-batch.
  struct Forward {
    std::shared_ptr<Pass> pass;
    std::vector<Packet> outputs;
    std::vector<int64_t> rows;
  };
  /// The driver of a forward pass, in one process or in several: the
  /// first stage's process sends `ends.inputs` in, the forward plan runs,
  /// the last stage's process takes the outputs. Call with the pipeline
  /// held (`begin_pass`).
  Forward forward(Endpoints& ends, const PassOptions& options);
  /// The driver of a training step, in one process or in several: `ends`
  /// says how the pass begins, its plan and targets, and how its loss is
  /// shared. `held` (from `begin_pass`) is let go before the input
  /// gradients go on into their graph.
  torch::Tensor train(
      Endpoints& ends,
      const LossFunction& loss_fn,
      const PassOptions& options,
      std::unique_lock<std::mutex>& held);

  /// Number of lanes.
  int64_t lanes() const {
    return static_cast<int64_t>(lanes_.size());
  }
  /// Which lane runs each partition.
  const Placement& placement() const {
    return placement_;
  }
  /// A one-lane-per-stage plan on this pipeline's lanes.
  Plan on_lanes(Plan flat) const;
  /// Throws `c10::ValueError` unless `plan` fits this pipeline (its stages,
  /// its lanes, `micro_batches` micro-batches, each stage on the lane the
  /// pipeline's placement gives) and is a whole training step that runs.
  void check_training_plan(const Plan& plan, int64_t micro_batches) const;
  /// check_training_plan, unless `plan` equals the one checked last for
  /// as many micro-batches; kept as the plan whose steps train() runs.
  /// Call with begin_pass()'s lock held (a distributed first stage checks
  /// its plan so before its pass begins).
  void check_training_plan_once(const Plan& plan, int64_t micro_batches);
  /// make_plan(schedule, micro_batches, placement()), made once and kept
  /// while the steps ask for the same schedule and micro-batches (a
  /// training step's plan does not change between steps).
  std::shared_ptr<const Plan> training_plan(
      Schedule schedule, int64_t micro_batches);

  /// Holds this pipeline for one pass: passes from several threads run one
  /// after the other. Refused from inside a cell (a nested pipeline), and
  /// in a child made by fork() after the pipeline was built.
  std::unique_lock<std::mutex> begin_pass();

  /// Runs a backward pass of `pass`'s cells, on the lanes (or inline: see
  /// Note [Backward on CUDA lanes]). Called by the autograd node with the
  /// pass held.
  void backward(const std::shared_ptr<Pass>& pass);

  /// Makes the transport of one run of `micro_batches` over the stages:
  /// in-process slots unless `set_transport_factory` gave another (the seam
  /// where stages in other processes plug in).
  using TransportFactory = std::function<std::unique_ptr<Transport>(
      int64_t micro_batches, int64_t stages)>;
  std::unique_ptr<Transport> make_transport(int64_t micro_batches) const;
  /// Set between passes.
  void set_transport_factory(TransportFactory factory) {
    transport_factory_ = std::move(factory);
  }

  /// DeferredBatchNorm statistics after a run: folded in, or (`ok` false)
  /// dropped.
  void commit_batch_norms(bool ok);

  /// A new pass of `m` micro-batches, its `grad` read from the inputs and
  /// the stages' parameters. Call with the pipeline held (`begin_pass`).
  std::shared_ptr<Pass> start_pass(
      int64_t m, const Batch& original_inputs, const PassOptions& options);
  /// Runs `plan` on the lanes, then commits (or, on error, drops) the
  /// DeferredBatchNorm statistics.
  /// `steps`, when given, are `plan.steps()`.
  void run_and_commit(
      const std::shared_ptr<Pass>& pass,
      const Plan& plan,
      const Steps* steps = nullptr);

  int64_t size() const {
    return static_cast<int64_t>(stages_.size());
  }
  /// Partition j's stage; only a local partition has one.
  Stage& stage(int64_t j) {
    TORCH_INTERNAL_ASSERT(
        stages_[j], "partition ", j, " runs in another process");
    return *stages_[j];
  }
  /// Lane `l`; only for a lane of a local partition.
  Lane& lane(int64_t l) {
    return *lanes_[l];
  }
  /// True when partition `j` runs in this process.
  bool is_local(int64_t j) const {
    return local_[j];
  }
  const std::vector<torch::Device>& devices() const {
    return devices_;
  }
  /// True when backward runs on the autograd engine's thread rather than on
  /// the lanes. See Note [Backward on CUDA lanes].
  bool backward_inline() const {
    return backward_inline_;
  }
  const SkipLayout& skip_layout() const {
    return skip_layout_;
  }
  /// Makes the CPU lanes share `cores` intra-op threads: a plan that never
  /// runs two CPU lanes at once runs on the calling thread with every core
  /// (Note [Threads that follow the plan] in lane_threads.cpp); the cells of
  /// other plans run on their lanes with the count those were made with. 0:
  /// no sharing. Set before the first pass.
  void share_threads(int64_t cores);
  int64_t shared_cores() const {
    return shared_cores_;
  }
  /// Per lane and cell of `plan`: the intra-op threads the cell runs with
  /// (0: as it is); empty when the lanes keep their counts.
  std::shared_ptr<const std::vector<std::vector<int64_t>>> threads_of(
      const Plan& plan);

  /// How long partition j's last cell in `phase` (a forward or a backward
  /// or either half of one) took on its own lane, at the lane's count, in
  /// seconds; 0 before one has run (Note [Wide cells on the calling thread]
  /// in wide_cells.cpp). Any thread may read it; the thread computing a cell
  /// of j sets it.
  double lane_cell_seconds(int64_t j, Phase phase) const;
  void set_lane_cell_seconds(int64_t j, Phase phase, double seconds);

  /// Where passes record their cells; null for none. Set between passes.
  void set_trace(std::shared_ptr<Trace> trace) {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    trace_ = std::move(trace);
  }
  std::shared_ptr<Trace> trace() const {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    return trace_;
  }

 private:
  std::vector<torch::Device> devices_;
  Placement placement_;
  SkipLayout skip_layout_;
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<bool> local_;  // per partition
  // Declared after stages_ so that lanes are joined before stages go away.
  // Null for a lane whose partitions run in another process.
  std::vector<std::unique_ptr<Lane>> lanes_;
  bool backward_inline_ = false;
  // getpid() at construction: Note [Lanes across fork()] in lane.cpp.
  int64_t process_ = current_process();
  TransportFactory transport_factory_;  // empty: in-process
  std::mutex pass_mutex_;
  // The last plan train() checked (check_training_plan), for as many
  // micro-batches as it has: an equal plan passes again without the check.
  Plan checked_plan_;  // guarded by pass_mutex_
  // Its steps (Plan::steps()), which a serial pass runs in order: made once
  // per plan, not per step.
  Steps checked_steps_;  // guarded by pass_mutex_
  std::mutex plan_mutex_;
  Schedule planned_schedule_ = Schedule::FillDrain;  // guarded by plan_mutex_
  std::shared_ptr<const Plan> planned_;  // made for it; guarded by plan_mutex_
  mutable std::mutex trace_mutex_;
  std::shared_ptr<Trace> trace_;  // guarded by trace_mutex_
  int64_t shared_cores_ = 0;
  // lane_cell_seconds in ns, [j * 4 + the phase's index].
  std::unique_ptr<std::atomic<int64_t>[]> lane_cell_ns_;
  // The threads of the last plans run (a forward's and a backward's
  // alternate), newest first.
  std::mutex threads_mutex_;
  std::vector<
      std::pair<Plan, std::shared_ptr<const std::vector<std::vector<int64_t>>>>>
      threads_cache_;  // guarded by threads_mutex_
};

}  // namespace gpipe::detail
