#pragma once

// The ends of a pass as one rank of a PipelineStage sees them: what the
// pipeline's own driver (Pipeline::forward, Pipeline::train) asks of a pass
// whose stages live in several processes. Rank 0 holds the first stage: it
// feeds the micro-batches in and starts the pass with a begin message
// carrying what every rank must agree on (the pass's kind, schedule,
// micro-batch rows and step seed). The last rank computes the loss and
// sends it to the others.

#include <gpipe/plan.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dist/agreement.h"
#include "dist/collective_pass.h"
#include "engine/endpoints.h"

namespace gpipe::detail {
class Pipeline;
}  // namespace gpipe::detail

namespace gpipe::dist::detail {

class Connection;
class GradientBuckets;

class RankEndpoints final : public gpipe::detail::Endpoints {
 public:
  /// `local` is this rank's view of the pass (its kind, and a training
  /// step's schedule or plan hash); `current` names the pass whose
  /// transport is made next; `buckets` are the local stages' gradient
  /// buckets (none without replicas).
  RankEndpoints(
      Connection& connection,
      gpipe::detail::Pipeline& pipeline,
      int64_t& current,
      std::vector<std::unique_ptr<GradientBuckets>>& buckets,
      int64_t pass_id,
      Sends& begin_sends,
      Begin local,
      int64_t ranks);

  /// A training step's own: a plan the user gave (else one of the agreed
  /// schedule), and the last rank's target, cut into `chunks` on `device`.
  const Plan* user_plan = nullptr;
  torch::Tensor target;
  int64_t chunks = 1;
  Checkpoint checkpoint = Checkpoint::ExceptLast;  // the rank's option
  torch::Device device = torch::kCPU;
  /// This pipeline's replica (its data rank in the Mesh): its micro-batch
  /// i is micro-batch replica * m + i of the replicas' whole batch, and its
  /// cells draw as that one's would.
  int64_t replica = 0;
  /// With replicas, on a stage without partition 0: called on the lane
  /// before this rank's first bucket of the step starts (it checks the
  /// buckets' layout against the other replicas': Note [The replicas'
  /// buckets agree] in dist/data_parallel.h).
  /// False: leave them unstarted (the step's end reports why).
  std::function<bool()> before_buckets;

  /// Rank 0 draws the seed it sends; the others draw theirs once the
  /// pass has begun (see begin()).
  bool seed_first() const override;
  void begin(gpipe::detail::PassStart& start) override;
  const Plan& plan(const gpipe::detail::PassStart& start) override;
  Plan arrange(Plan plan) const override;
  [[noreturn]] void refuse(std::exception_ptr error) override;
  std::vector<torch::Tensor> targets(
      const gpipe::detail::PassStart& start) override;
  void prepare(gpipe::detail::Pass& pass) override;
  torch::Tensor loss(gpipe::detail::Pass& pass) override;
  void end(gpipe::detail::Pass& pass) override;

  /// On the first stage, before the pass begins (and, with replicas,
  /// before they agree to start it): makes the step's plan for
  /// `micro_batches` and checks that it fits the pipeline, throwing the
  /// c10::ValueError the pass would refuse it with. A plan that does not
  /// fit one replica is then refused by every replica alike, not found
  /// by that replica alone while the others run.
  void check_plan(int64_t micro_batches);

  /// Rows of the pass's mini-batch, as the first rank gave them (known on
  /// every rank once the pass has begun).
  int64_t rows() const;

 private:
  bool last_here() const;
  /// The rank of the last stage (lane l is rank l).
  int64_t last_rank() const;

  Connection& connection_;
  gpipe::detail::Pipeline& pipeline_;
  int64_t& current_;
  std::vector<std::unique_ptr<GradientBuckets>>& buckets_;
  const int64_t pass_id_;
  Sends& begin_sends_;
  Begin local_;
  Begin agreed_;
  const int64_t ranks_;
  Plan made_;
  int64_t made_for_ = -1;  // made_'s micro-batches; -1: none made
};

}  // namespace gpipe::dist::detail
