// PipelineStage's side of the replicas (Note [Gradient buckets] in
// data_parallel.h): its gradient buckets, kept between steps, and what a
// training step adds to the pipeline's own pass (run_pipeline_step in
// pipeline_stage.cpp): the buckets started and waited for, the loss
// averaged, a failure in another replica passed on.

#include <c10/util/Exception.h>
#include <gpipe/dist.h>
#include <torch/torch.h>

#include <exception>
#include <memory>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>
#include <vector>

#include "dist/connection.h"
#include "dist/data_parallel.h"
#include "dist/stage_engine.h"
#include "text.h"

namespace gpipe::dist {

void PipelineStageImpl::set_gradient_bucket_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(
      bytes > 0,
      "set_gradient_bucket_bytes expects a positive number of bytes, but got ",
      bytes);
  engine_->bucket_bytes = bytes;
}

int64_t PipelineStageImpl::gradient_bucket_bytes() const {
  return engine_->bucket_bytes;
}

torch::Tensor PipelineStageImpl::run_train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    Schedule schedule,
    const Plan* plan) {
  const auto& data = mesh_.data();
  if (data.size() > 1) {
    // Kept between steps unless what trains changed (a layer frozen or
    // thawed) or the bucket size did.
    auto& buckets = engine_->buckets;
    bool same = buckets.size() == partitions_.size() &&
                engine_->bucket_bytes == engine_->buckets_made_with;
    for (size_t k = 0; same && k < partitions_.size(); ++k) {
      same = buckets[k]->holds(partitions_[k]->parameters());
    }
    if (!same) {
      buckets.clear();
      for (const auto& part : partitions_) {
        buckets.push_back(std::make_unique<detail::GradientBuckets>(
            data, part->parameters(), engine_->bucket_bytes));
      }
      engine_->buckets_made_with = engine_->bucket_bytes;
    }
  }
  // A later stage's first words over the replicas, begun once its pass
  // has begun (run_pipeline_step) and read before the gradients'
  // all-reduce: this call's own unless a step of this stage was under way
  // already (a train_step called from inside one of its cells, refused).
  const bool outer_step = engine_->step_start.has_value();
  torch::Tensor loss;
  try {
    loss = run_pipeline_step(
        std::move(input), std::move(target), loss_fn, schedule, plan);
  } catch (...) {
    // A pass that failed this replica's pipeline fails the other replicas
    // too (their gradient all-reduce would wait for this one); a refusal
    // that every replica makes alike leaves the stage usable.
    if (const auto failure = engine_->connection->failure()) {
      if (data.size() > 1) {
        data.connection()->fail(*failure);
      }
      if (!outer_step && engine_->step_start) {
        // Gloo may still write into its words.
        detail::keep_forever(std::move(engine_->step_start->work));
      }
    } else if (!outer_step && engine_->step_start) {
      // Every replica began it, and refuses this step alike.
      try {
        detail::finish_first_collective(
            *data.connection(), *engine_->step_start);
      } catch (...) {
        // The refusal is what this step reports.
      }
    }
    if (!outer_step) {
      engine_->step_start.reset();
    }
    throw;
  }
  if (data.size() > 1) {
    try {
      loss = average_over_replicas(loss);
    } catch (...) {
      std::rethrow_exception(failed_over_replicas(std::current_exception()));
    }
  }
  return loss;
}

torch::Tensor PipelineStageImpl::average_over_replicas(torch::Tensor loss) {
  const auto& data = mesh_.data();
  // The step's first words over the replicas first: where they failed (a
  // rank of another replica died), the lane left its buckets unstarted.
  engine_->finish_step_start(data, mesh_.data_rank(), /*on_lane=*/false);
  // Each stage's buckets started on its lane as soon as its gradients
  // were final (Note [Gradient buckets]); a plan without a backward of a
  // stage leaves its buckets to start here.
  for (auto& buckets : engine_->buckets) {
    if (!buckets->started()) {
      buckets->start();
    }
  }
  const auto trace = engine_->current_trace();
  for (auto& buckets : engine_->buckets) {
    buckets->finish(trace.get(), world_.rank());
  }
  // The loss's sum over the replicas (their shards were agreed equal
  // before the step began: agree_to_start).
  std::vector<torch::Tensor> summed_on{
      loss.detach().to(torch::kDouble).reshape({1})};
  data.connection()->all_reduce(
      summed_on, c10d::ReduceOp::SUM, "loss all-reduce over the replicas");
  const auto replicas = static_cast<double>(data.size());
  auto sums = summed_on[0];
  return (sums[0] / replicas).to(loss.scalar_type());  // on loss's device
}

bool PipelineStageImpl::Engine::finish_step_start(
    const World& data, int64_t replica, bool on_lane) {
  std::optional<detail::PendingFirstCollective> started;
  {
    std::lock_guard<std::mutex> lock(step_start_mutex);
    if (step_start_failure) {
      if (on_lane) {
        return false;
      }
      std::rethrow_exception(std::exchange(step_start_failure, nullptr));
    }
    // Another lane of this rank is reading the words.
    if (on_lane && step_start_finishing) {
      return true;
    }
    if (!step_start) {
      return true;
    }
    // A lane does not wait for a replica that is late to begin the step
    // (stalled, or slow: the lane would stop sending to its neighbours, and
    // they would blame it). Its buckets start unchecked, after the words on
    // the group as always, and the words are read at the step's end. (Not
    // deferred: a replica whose words came in time would start its
    // stages' buckets in the lane's order, one deferring them in stage
    // order, and their collectives would not match.)
    if (on_lane && step_start->work && !step_start->work->isCompleted()) {
      return true;
    }
    started = std::move(step_start);
    step_start.reset();
    step_start_finishing = true;
  }
  std::exception_ptr error;
  bool disagree = false;
  try {
    const auto reduced =
        detail::finish_first_collective(*data.connection(), *started);
    error = detail::buckets_disagree(
        reduced, step_words, detail::dtypes_of(buckets), replica);
    disagree = error != nullptr;
  } catch (...) {
    error = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(step_start_mutex);
  step_start_finishing = false;
  if (!error) {
    return true;
  }
  // Kept, so that every later call sees it: a lane's leaves its buckets
  // unstarted, the step's end throws it. A disagreement is thrown on the
  // lane at once too, failing the pass before any bucket starts.
  step_start_failure = error;
  if (on_lane && !disagree) {
    return false;
  }
  if (!on_lane) {
    step_start_failure = nullptr;
  }
  std::rethrow_exception(error);
}

// A rank of another replica failed while this one averaged: a rank that
// shares a data World with it may hear only that its collective broke
// (its peer there died), where a neighbour in this replica's pipeline heard
// which rank failed (from its own data World). So the failure is passed on
// to this replica's pipeline, and a rank whose own error names no rank
// waits a moment for a neighbour's that does.
std::exception_ptr PipelineStageImpl::failed_over_replicas(
    std::exception_ptr error) {
  auto& pipeline = *engine_->connection;
  bool named = false;
  try {
    std::rethrow_exception(error);
  } catch (const gpipe::detail::RelayedFailure&) {
    named = true;  // a failure notice, as the failing rank wrote it
  } catch (...) {
  }
  if (!named) {
    pipeline.await_failure_notice();
    if (pipeline.failure()) {
      try {
        pipeline.check();
      } catch (...) {
        return std::current_exception();
      }
    }
  }
  pipeline.fail_with(error);
  return error;
}

}  // namespace gpipe::dist
