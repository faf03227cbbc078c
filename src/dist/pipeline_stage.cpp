// PipelineStage: one rank's partition of a pipeline whose stages live in
// several processes. The passes run the single-process engine's plans, of
// which each rank runs its own lane; rank 0 starts each pass with a message
// that carries what every rank must agree on (the pass's kind, schedule,
// micro-batch sizes and step seed).

#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/dist.h>
#include <gpipe/microbatch.h>
#include <gpipe/module.h>
#include <gpipe/plan.h>
#include <gpipe/skip.h>
#include <gpipe/trace.h>
#include <gpipe/verify.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstring>
#include <functional>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "device.h"
#include "dist/agreement.h"
#include "dist/c10d_transport.h"
#include "dist/collective_pass.h"
#include "dist/connection.h"
#include "dist/data_parallel.h"
#include "dist/rank_endpoints.h"
#include "dist/stage_engine.h"
#include "engine/autograd_node.h"
#include "engine/partitions.h"
#include "engine/pipeline.h"
#include "random.h"
#include "text.h"

namespace gpipe::dist {

using detail::Begin;
using detail::C10dTransport;
using detail::Message;
using detail::MessageId;
using detail::MessageKind;
using detail::PassKind;

PipelineStageImpl::PipelineStageImpl(
    torch::nn::Sequential module, GPipeOptions options_, World world)
    : PipelineStageImpl(
          std::move(module), std::move(options_), Mesh(world, world.size())) {}

PipelineStageImpl::PipelineStageImpl(
    torch::nn::Sequential module, GPipeOptions options_, Mesh mesh)
    : options(std::move(options_)),
      built_(options),
      mesh_(std::move(mesh)),
      world_(mesh_.pipeline()) {
  const auto rank = world_.rank();
  const auto size = world_.size();
  auto& connection = world_.connection();
  // Each rank publishes what it built (or why it could not) under this
  // prefix, and reads the others'.
  const auto stage_id = connection->next_stage_id();
  const auto prefix = "stage" + std::to_string(stage_id) + "/";
  // The replicas of this stage agree too, in their own World.
  auto& replicas = mesh_.data().connection();
  const auto replicas_prefix =
      "stage" + std::to_string(replicas->next_stage_id()) + "/";
  const auto n = static_cast<int64_t>(options.balance().size());
  try {
    detail::verify_stage_options(module, options, size);
    if (!options.devices().empty()) {
      verify_devices(options.devices(), size);  // one per rank
      device_ = gpipe::detail::normalize_device(options.devices()[rank]);
    } else if (torch::cuda::is_available()) {
      device_ = torch::Device(torch::kCUDA, world_.local_rank());
    }
    if (options.deferred_batch_norm()) {
      module = convert_deferred_batch_norm(module, options.chunks());
    }
  } catch (...) {
    // Tell the others at once, rather than leaving them waiting.
    const auto why = detail::message_of(std::current_exception());
    detail::publish_build_error(*connection, prefix, why);
    if (replicas->size > 1) {
      detail::publish_build_error(*replicas, replicas_prefix, why);
    }
    throw;
  }

  // Every rank must have built the same thing: compare before any pass.
  engine_ = std::make_shared<Engine>();
  engine_->connection = connection;
  engine_->stage_id = stage_id;
  const auto fields = detail::fingerprint(module, options, size);
  const auto details = detail::fingerprint_details(module);
  try {
    detail::agree_on_build(*connection, prefix, fields, details);
  } catch (...) {
    // This replica's ranks differ: the other replicas, which wait for this
    // rank in their own agreement below, hear why at once.
    if (replicas->size > 1) {
      detail::publish_build_error(
          *replicas,
          replicas_prefix,
          detail::message_of(std::current_exception()));
    }
    throw;
  }
  if (replicas->size > 1) {
    detail::agree_on_build(*replicas, replicas_prefix, fields, details);
  }

  // Split the layers; each keeps its name. Only this rank's partitions
  // (those its placement puts on lane `rank`) move to its device and become
  // this module's.
  const auto placement = gpipe::detail::placement_of(options);
  const auto skips_by_place = detail::skips_by_place(module);
  auto parts = gpipe::detail::split_partitions(module, options.balance());
  auto holder =
      register_module("partitions", std::make_shared<torch::nn::Module>());
  std::vector<torch::Device> devices(n, torch::kCPU);
  std::vector<bool> local(n, false);
  for (const auto j : placement.stages_of(rank)) {
    parts[j]->to(device_);
    holder->register_module(std::to_string(j), parts[j]);
    partitions_.push_back(parts[j]);
    devices[j] = device_;
    local[j] = true;
  }
  const auto threads =
      options.threads_per_lane() > 0
          ? options.threads_per_lane()
          : std::max<int64_t>(
                1,
                static_cast<int64_t>(std::thread::hardware_concurrency()) /
                    std::max<int64_t>(1, world_.local_size()));
  threads_per_lane_ = threads;
  engine_->pipeline = std::make_shared<gpipe::detail::Pipeline>(
      parts, devices, threads, local, placement);

  auto& routes = engine_->routes;
  for (const auto j : c10::irange(n)) {
    routes.rank_of_stage.push_back(placement.lane_of(j));
  }
  // Skips between partitions are numbered by their place in the model, the
  // same on every rank (not by namespace, whose ids depend on the order in
  // which each rank made them); the ranks agreed on the places above.
  const auto& skips = engine_->pipeline->skip_layout();
  int64_t index = 0;
  for (const auto& place : skips_by_place) {
    if (skips.requires_copy(place.key)) {
      routes.skip_index[place.key] = index++;
      routes.skip_route[place.key] = skips.route(place.key);
    }
  }
  TORCH_CHECK_VALUE(
      index <= detail::kMaxIndex,
      "gpipe::dist::PipelineStage supports at most ",
      detail::kMaxIndex,
      " skips between partitions, but got ",
      index);
  // The replicas start from data rank 0's parameters and buffers, as DDP's.
  if (replicas->size > 1) {
    std::vector<torch::Tensor> state;
    for (const auto& part : partitions_) {
      for (auto& p : part->parameters()) {
        state.push_back(p);
      }
      for (auto& b : part->buffers()) {
        state.push_back(b);
      }
    }
    detail::broadcast_from_first_replica(mesh_.data(), state);
  }
  Engine* engine = engine_.get();
  engine_->pipeline->set_transport_factory([engine](int64_t m, int64_t stages) {
    return std::make_unique<C10dTransport>(
        engine->connection,
        engine->current,
        m,
        stages,
        engine->routes,
        engine->current_trace());
  });
}

PipelineStageImpl::~PipelineStageImpl() = default;

using detail::AgreedRefusal;
using detail::collective_pass;
using detail::RankEndpoints;
using detail::scatter_input;
using detail::Sends;

namespace {

// Whether a pass of `stage` trains: while any of its layers does.
bool training(const PipelineStageImpl& stage) {
  std::vector<std::shared_ptr<torch::nn::Module>> parts;
  for (const auto& part : stage.partitions()) {
    parts.push_back(part.ptr());
  }
  return gpipe::detail::layers_training(parts, stage.is_training());
}

// Rank 0's own arguments (its input, loss_fn, grad mode), checked before
// the pass begins: a mistake there is refused by every rank alike and the
// connection stays open. With replicas, a training step's gradients are
// all-reduced over them, so the replicas' first stages agree first
// (agree_to_start): one that refuses the step, or shards of different
// rows, make every replica refuse it.
void refusable(
    const Mesh& mesh,
    bool train,
    const std::vector<std::unique_ptr<detail::GradientBuckets>>& buckets,
    int64_t bucket_bytes,
    detail::Connection& connection,
    int64_t pass,
    Sends& begin_sends,
    const std::function<int64_t()>& check) {
  std::exception_ptr error;
  int64_t rows = 0;
  try {
    rows = check();
  } catch (const c10::Error&) {
    error = std::current_exception();
  }
  if (train && mesh.data_size() > 1) {
    error = detail::agree_to_start(
        mesh.data(), pass, rows, error, buckets, bucket_bytes);
  }
  if (error) {
    detail::refuse_pass(connection, pass, error, begin_sends);
  }
}

}  // namespace

torch::Tensor PipelineStageImpl::train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    Schedule schedule) {
  return run_train_step(
      std::move(input), std::move(target), loss_fn, schedule, nullptr);
}

torch::Tensor PipelineStageImpl::train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    const Plan& plan) {
  return run_train_step(
      std::move(input), std::move(target), loss_fn, Schedule::FillDrain, &plan);
}

torch::Tensor PipelineStageImpl::run_pipeline_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    Schedule schedule,
    const Plan* plan) {
  const bool first = engine_->pipeline->is_local(0);
  return collective_pass(
      *engine_->connection,
      *engine_->pipeline,
      [this] { return engine_->next_pass(); },
      [&](int64_t pass_id,
          Sends& begin_sends,
          std::unique_lock<std::mutex>& held) {
        // With replicas, a later stage begins the words every operation on
        // the data World begins with; the step reads them before its
        // gradients' all-reduce (Note [The first collective's words] in
        // dist/connection_collectives.cpp). A replica's first stage agrees
        // with the others' before the pass instead (agree_to_start).
        if (mesh_.data_size() > 1 && !first && !engine_->step_start) {
          engine_->step_words =
              detail::bucket_words(engine_->buckets, engine_->bucket_bytes);
          engine_->step_start_failure = nullptr;
          engine_->step_start = detail::start_first_collective(
              *mesh_.data().connection(),
              detail::FirstCollective::StepStart,
              engine_->step_words,
              0,
              "train_step's start over the replicas");
        }
        // A mistake on one rank fails the pass on every rank, rather than
        // leaving the others waiting; on rank 0, before the pass begins, it
        // is refused by every rank (refusable).
        auto check_arguments = [&] {
          gpipe::detail::verify_layout_unchanged(
              options, built_, "gpipe::dist::PipelineStage");
          gpipe::detail::verify_checkpoint_mode(options.checkpoint());
          TORCH_CHECK_VALUE(
              static_cast<bool>(loss_fn),
              "train_step expects a loss_fn, but got none");
          TORCH_CHECK_VALUE(
              torch::GradMode::is_enabled(),
              "train_step needs grad mode on, but it is off "
              "(torch::NoGradGuard or InferenceMode)");
        };
        if (!first) {
          check_arguments();
        }
        Begin local;
        local.kind = PassKind::Train;
        local.schedule = static_cast<int64_t>(schedule);
        if (plan != nullptr) {
          local.schedule = detail::kPlanSchedule;
          local.plan_text = detail::plan_identity(*plan);
          local.plan_hash = std::hash<std::string>{}(local.plan_text);
          if (engine_->connection->rank == 0 &&
              engine_->published_plan != local.plan_hash) {
            // Only for what a rank whose plan differs says: a store that
            // fails here fails the step where it matters, not here.
            try {
              detail::publish_plan(
                  *engine_->connection, local, engine_->published_plan);
              engine_->published_plan = local.plan_hash;
            } catch (const std::exception&) {
              // (The hashes alone then tell a difference.)
            }
          }
        }
        RankEndpoints ends(
            *engine_->connection,
            *engine_->pipeline,
            engine_->current,
            engine_->buckets,
            pass_id,
            begin_sends,
            local,
            world_.size());
        ends.user_plan = plan;
        ends.replica = mesh_.data_rank();
        ends.target = target;
        ends.chunks = options.chunks();
        ends.checkpoint = options.checkpoint();
        ends.device = device_;
        if (!first && mesh_.data_size() > 1) {
          ends.before_buckets = [this] {
            return engine_->finish_step_start(
                mesh_.data(), mesh_.data_rank(), /*on_lane=*/true);
          };
        }
        if (first) {
          refusable(
              mesh_,
              /*train=*/true,
              engine_->buckets,
              engine_->bucket_bytes,
              *engine_->connection,
              pass_id,
              begin_sends,
              [&] {
                check_arguments();
                ends.inputs = scatter_input(
                    input,
                    options.chunks(),
                    "train_step",
                    *engine_->connection);
                ends.check_plan(static_cast<int64_t>(ends.inputs.size()));
                return input.size(0);
              });
          ends.originals = {input};
        }
        auto loss = engine_->pipeline->train(
            ends,
            loss_fn,
            gpipe::detail::pass_options(training(*this), options),
            held);
        return loss;
      });
}

std::vector<int64_t> PipelineStageImpl::partition_indices() const {
  return placement().stages_of(world_.rank());
}

Placement PipelineStageImpl::placement() const {
  return engine_->pipeline->placement();
}

torch::Tensor PipelineStageImpl::forward(torch::Tensor input) {
  const bool first = engine_->pipeline->is_local(0);
  torch::NoGradGuard no_grad;
  return collective_pass(
      *engine_->connection,
      *engine_->pipeline,
      [this] { return engine_->next_pass(); },
      [&](int64_t pass_id, Sends& begin_sends, std::unique_lock<std::mutex>&) {
        auto check_layout = [&] {
          gpipe::detail::verify_layout_unchanged(
              options, built_, "gpipe::dist::PipelineStage");
        };
        if (!first) {
          check_layout();
        }
        Begin local;
        local.kind = PassKind::Forward;
        RankEndpoints ends(
            *engine_->connection,
            *engine_->pipeline,
            engine_->current,
            engine_->buckets,
            pass_id,
            begin_sends,
            local,
            world_.size());
        ends.replica = mesh_.data_rank();
        ends.chunks = options.chunks();
        ends.checkpoint = options.checkpoint();
        if (first) {
          refusable(
              mesh_,
              /*train=*/false,
              engine_->buckets,
              engine_->bucket_bytes,
              *engine_->connection,
              pass_id,
              begin_sends,
              [&] {
                check_layout();
                ends.inputs = scatter_input(
                    input, options.chunks(), "forward", *engine_->connection);
                return input.size(0);
              });
        }
        auto done = engine_->pipeline->forward(
            ends, gpipe::detail::PassOptions{training(*this), 0});
        if (done.outputs.empty()) {
          return torch::Tensor();  // not the last rank
        }
        std::vector<Batch> outputs;
        for (auto& packet : done.outputs) {
          TORCH_CHECK_TYPE(
              packet.atomic && packet.tensors.size() == 1,
              "the last layer returned ",
              packet.tensors.size(),
              " tensors; gpipe::dist::PipelineStage::forward returns one");
          outputs.push_back(std::move(packet.tensors));
        }
        return gather(outputs)[0];
      });
}

void PipelineStageImpl::to(
    torch::Device device, torch::Dtype dtype, bool non_blocking) {
  TORCH_CHECK_TYPE(
      false,
      "gpipe::dist::PipelineStage refuses to move to ",
      device,
      ": its device is fixed at construction; cast the dtype alone with "
      "to(dtype)");
}

void PipelineStageImpl::to(torch::Dtype dtype, bool non_blocking) {
  for (auto& part : partitions_) {
    part->to(device_, dtype, non_blocking);
  }
}

void PipelineStageImpl::to(torch::Device device, bool non_blocking) {
  TORCH_CHECK_TYPE(
      false,
      "gpipe::dist::PipelineStage refuses to move to ",
      device,
      ": its device is fixed at construction");
}

void PipelineStageImpl::set_trace(std::shared_ptr<Trace> trace) {
  engine_->pipeline->set_trace(trace);
  std::lock_guard<std::mutex> lock(engine_->trace_mutex);
  engine_->trace = std::move(trace);
}

std::shared_ptr<Trace> PipelineStageImpl::trace() const {
  return engine_->current_trace();
}

void PipelineStageImpl::pretty_print(std::ostream& stream) const {
  stream << "gpipe::dist::PipelineStage(rank=" << world_.rank() << "/"
         << world_.size() << ", balance=" << c10::IntArrayRef(built_.balance())
         << ", chunks=" << options.chunks();
  if (mesh_.data_size() > 1) {
    stream << ", replica=" << mesh_.data_rank() << "/" << mesh_.data_size();
  }
  // As GPipe prints it.
  if (!built_.placement().empty()) {
    stream << ", placement=" << to_string(built_.placement());
  } else if (built_.stages_per_lane() > 1) {
    stream << ", stages_per_lane=" << built_.stages_per_lane();
  }
  stream << ", checkpoint=" << to_string(options.checkpoint())
         << ", device=" << device_ << ")";
}

}  // namespace gpipe::dist
