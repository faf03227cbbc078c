#pragma once

// The plan runner: one pass (forward, backward or a training step) of a plan
// over the pipeline's lanes. Each lane runs its plan row in order; a cell
// takes its inputs from the transport, runs on its stage, and sends its
// outputs on. The first error wins: it aborts the transport, cells already
// running finish, nothing new starts, and every lane has finished its row
// before the error reaches the caller.

#include <gpipe/options.h>
#include <gpipe/plan.h>

#include <functional>
#include <memory>
#include <vector>

#include "engine/lane.h"
#include "engine/stage.h"
#include "engine/transport.h"

namespace gpipe::detail {

class Pipeline;

/// Runs a cell's compute (its messages taken, not yet sent) on another
/// thread, and returns once it has, rethrowing its error (Note [Wide cells
/// on the calling thread]).
using ComputeOn = std::function<void(const std::function<void()>&)>;

/// How one pass runs.
struct PassOptions {
  bool training = true;
  /// Micro-batches `i < checkpoint_stop` are checkpointed (when a graph is
  /// built at all).
  int64_t checkpoint_stop = 0;
};

/// How a pass of a model with `options` runs in train() (`training`) or
/// eval() mode: which micro-batches are checkpointed (none in eval mode).
PassOptions pass_options(bool training, const GPipeOptions& options);

/// One forward (and its later backward), or one training step: the cells'
/// saved state and what every cell of the pass shares.
class Pass {
 public:
  Pass(Pipeline& pipeline, int64_t micro_batches, PassOptions options);

  /// A fresh transport for the next run (forward, then backward).
  void reset_transport();
  Transport& transport() {
    return *transport_;
  }

  /// Runs `plan` on the lanes (or on this thread, in plan order, when
  /// `inline_cells` or when the plan is serial: Note [A serial plan on the
  /// calling thread]), and rethrows the first error once every lane is
  /// done.
  /// `self` keeps the pass alive in the lanes' tasks. `steps`, when given,
  /// are `plan.steps()`, kept from an earlier pass of the same plan.
  void run(
      const Plan& plan,
      bool inline_cells,
      const std::shared_ptr<Pass>& self,
      const Steps* steps = nullptr);

  int64_t micro_batches() const {
    return m_;
  }

  /// Grad mode was on and something required grad: cells build graphs.
  bool grad = false;
  uint64_t step_seed = 0;
  /// Added to a micro-batch's index where its cells' seeds are made: a
  /// replica of a pipeline (gpipe::dist::Mesh) whose micro-batches are
  /// micro-batches d * m ... d * m + m - 1 of the whole batch draws what
  /// one pipeline would draw for those (Note [Random streams of concurrent
  /// cells]), not what every other replica draws.
  int64_t seed_offset = 0;
  /// Makes this pass a training step: the last stage computes the loss of
  /// each micro-batch (of `rows[i]` rows, its target `targets[i]`), scaled
  /// by its share of the batch, and backward starts from it.
  void train_with(
      const LossFunction& loss_fn,
      std::vector<torch::Tensor> targets,
      const std::vector<int64_t>& rows);

  /// Set by train_with.
  const LossFunction* loss_fn = nullptr;
  std::vector<torch::Tensor> targets;
  std::vector<double> loss_scales;
  std::vector<torch::Tensor> losses;  // detached, per micro-batch
  bool retain = false;                // backward keeps the cells (retain_graph)
  /// Called on a local stage's lane when the last cell of the run that
  /// makes the stage's parameter gradients (its last B or W) has ended
  /// without error: the stage's gradients are final (gpipe::dist starts
  /// their all-reduce over the replicas there). An error it throws fails
  /// the pass.
  std::function<void(int64_t stage)> on_gradients_final;
  /// Called on the lane just before that last cell starts (when
  /// on_gradients_final is set): gradients accumulated from then on are
  /// final as soon as they are.
  std::function<void(int64_t stage)> before_final_gradients;
  bool consumed = false;  // a backward freed the cells

 private:
  // Takes the cell's messages, computes it (here, or where `compute_on`
  // says) and sends its results, on this thread; an error is recorded and
  // aborts the transport.
  void run_cell(
      const Cell& cell, int64_t lane, const ComputeOn* compute_on = nullptr);
  // run_cell, with on_gradients_final's calls around it when the cell is
  // the last of `final_stage`'s gradients (-1: it is not).
  void run_cell_of_row(
      const Cell& cell,
      int64_t lane,
      int64_t final_stage,
      const ComputeOn* compute_on = nullptr);
  // Every compute cell of `plan` gets every shared core (`threads`: the
  // pipeline's threads_of), and every lane is a CPU lane of this process.
  bool serial(
      const Plan& plan, const std::vector<std::vector<int64_t>>* threads) const;
  // Each lane's row as one task on that lane; the long cells the plan runs
  // alone (`threads`: the pipeline's threads_of, null where the lanes keep
  // their counts) on this thread with every core (Note [Wide cells on the
  // calling thread]).
  void run_lanes(
      const Plan& plan,
      std::vector<std::vector<int64_t>> finals,
      const std::vector<std::vector<int64_t>>* threads,
      const std::shared_ptr<Pass>& self);
  // Calls before_final_gradients(stage) (`before`) or
  // on_gradients_final(stage) unless the pass has failed; an error it
  // throws becomes the pass's.
  void gradients_final(int64_t stage, bool before);
  void forward_cell(
      int64_t i, int64_t j, int64_t lane, const ComputeOn* compute_on);
  void loss_cell(int64_t i, int64_t lane);
  void backward_cell(
      int64_t i,
      int64_t j,
      int64_t lane,
      bool input_only,
      const ComputeOn* compute_on);
  CellContext context(int64_t i, int64_t j, int64_t lane) const;

  Pipeline& pipeline_;
  const int64_t m_;
  const int64_t n_;
  const PassOptions options_;
  std::shared_ptr<Trace> trace_;  // null when not tracing
  // The caller's when the pass began (Note [Autocast in cells]).
  const AutocastState autocast_;
  std::unique_ptr<Transport> transport_;
  // Cell (i, j) is touched by its stage's lane only while a run is on, by
  // the caller between runs.
  std::vector<std::vector<CellState>> cells_;
  FirstError error_;
  // The plan being run lists its losses; else each follows its forward.
  bool explicit_losses_ = false;
  // The plan being run lists its transfers between lanes: a message that
  // crosses lanes waits in an outbox ([i][j]: what stage j made for
  // micro-batch i) for its send; else cells send when they end.
  bool explicit_transfers_ = false;
  std::vector<int64_t> lane_of_stage_;
  std::vector<std::vector<Packet>> forward_outbox_;
  std::vector<std::vector<Packet>> backward_outbox_;
  // A message between stages j and j + 1 waits for a listed send.
  bool held(int64_t j) const;
};

}  // namespace gpipe::detail
