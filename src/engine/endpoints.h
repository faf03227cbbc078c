#pragma once

// Endpoints: what differs between a pass whose stages all run in this
// process and one process's share of a pass across several (gpipe::dist).
// The driver (Pipeline::forward and Pipeline::train) is the same for both;
// it asks its Endpoints how the processes agree on the pass, which plan a
// training step runs, where the targets are and how the loss is shared.
// Where the input and the output live follows from the pipeline itself:
// the first stage's process feeds the micro-batches in, the last stage's
// computes the loss and receives the outputs.

#include <gpipe/plan.h>
#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "engine/runner.h"
#include "packet.h"

namespace gpipe::detail {

/// What every process running a pass must agree on before any cell.
struct PassStart {
  /// Rows of each micro-batch (known first where the input is).
  std::vector<int64_t> rows;
  /// The step seed of every cell's random stream.
  uint64_t seed = 0;
  /// Set by begin() when `seed` came from another process: it is not
  /// drawn here after begin().
  bool seed_agreed = false;
  PassOptions options;
};

/// The ends of one pass as this process sees them. The defaults are a
/// pipeline whose stages are all in this process.
class Endpoints {
 public:
  virtual ~Endpoints() = default;

  /// The first stage's micro-batches when its partition is here (left
  /// empty elsewhere); the driver sends them in.
  std::vector<Packet> inputs;
  /// The tensors `inputs` were cut from: after a training step their
  /// gradient, joined from the micro-batches', goes on into their graph.
  Batch originals;

  /// Whether begin() needs the step seed (drawn here, to be agreed on):
  /// else it is drawn once the pass has passed its checks, so that a
  /// refused pass leaves the user's generator as it was.
  virtual bool seed_first() const {
    return false;
  }

  /// Makes the processes of a pass agree on `start` (filled from what is
  /// here: the rows of `inputs`, and with seed_first() a seed drawn here).
  /// Called with the pipeline held, before the pass starts.
  virtual void begin(PassStart& start) {}

  /// The plan of a training step of `start.rows.size()` micro-batches;
  /// it lives as long as the Endpoints.
  virtual const Plan& plan(const PassStart& start) = 0;

  /// How `plan`'s messages move: in one process each cell sends when it
  /// ends; across processes the plan lists its transfers.
  virtual Plan arrange(Plan plan) const {
    return plan;
  }

  /// Called when the plan does not fit the pipeline or the pass: throws.
  /// The default rethrows `error`.
  [[noreturn]] virtual void refuse(std::exception_ptr error) {
    std::rethrow_exception(error);
  }

  /// The targets of each micro-batch where the last stage is here, else
  /// none.
  virtual std::vector<torch::Tensor> targets(const PassStart& start) = 0;

  /// Called on the new pass before it runs.
  virtual void prepare(Pass& pass) {}

  /// The step's loss, once the plan ran: by default the sum of the
  /// micro-batches' losses computed here.
  virtual torch::Tensor loss(Pass& pass);

  /// Called with the pipeline still held after the outputs (forward) or
  /// the loss and the input gradients (training) were taken: the pass's
  /// messages are done.
  virtual void end(Pass& pass) {}
};

/// The Endpoints of a pass in one process: for a training step, a plan and
/// targets made beforehand.
class LocalEndpoints final : public Endpoints {
 public:
  /// The training step's plan (unused by a forward pass).
  const Plan* training_plan = nullptr;
  std::vector<torch::Tensor> micro_targets;

  const Plan& plan(const PassStart&) override {
    TORCH_INTERNAL_ASSERT(training_plan != nullptr);
    return *training_plan;
  }
  std::vector<torch::Tensor> targets(const PassStart&) override {
    return std::move(micro_targets);
  }
};

}  // namespace gpipe::detail
