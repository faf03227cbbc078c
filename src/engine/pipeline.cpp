#include "engine/pipeline.h"

#include <c10/util/irange.h>
#include <gpipe/plan.h>
#include <torch/autograd.h>

#include <algorithm>
#include <optional>

#include "cell_generator.h"
#include "device.h"
#include "engine/autograd_node.h"
#include "engine/in_process_transport.h"
#include "engine/lane_threads.h"
#include "random.h"
#include "schedule/plan_builders.h"
#include "text.h"

namespace gpipe::detail {

// Note [Backward on CUDA lanes]
// The pipeline's autograd node runs on the thread the autograd engine gives
// it. For CPU tensors that is the thread that called backward(), and lanes
// calling torch::autograd::backward run their own graph tasks on their own
// threads. For CUDA tensors the engine runs every node on one shared thread
// per device; our node would occupy it while lanes queue their work on it, a
// deadlock. With a CUDA device in the pipeline the backward cells therefore
// run on the node's thread, in plan order, as reentrant backward calls; the
// GPU still overlaps partitions because kernel launches are asynchronous.

Pipeline::Pipeline(
    std::vector<torch::nn::Sequential> partitions,
    std::vector<torch::Device> devices,
    int64_t threads_per_lane,
    std::vector<bool> local,
    Placement placement)
    : devices_(std::move(devices)),
      placement_(
          placement.empty()
              ? Placement::modulo(static_cast<int64_t>(partitions.size()))
              : std::move(placement)),
      skip_layout_(partitions) {
  const auto n = partitions.size();
  TORCH_INTERNAL_ASSERT(n == devices_.size());
  TORCH_INTERNAL_ASSERT(local.empty() || local.size() == n);
  TORCH_INTERNAL_ASSERT(placement_.stages() == static_cast<int64_t>(n));
  local_ = local.empty() ? std::vector<bool>(n, true) : local;
  // The dispatcher takes kernels before any lane runs, not while lanes
  // dispatch (cell_generator.h).
  if (std::any_of(devices_.begin(), devices_.end(), [](const auto& d) {
        return d.is_cpu();
      })) {
    cell_generators_available();
  }
  lane_cell_ns_ = std::make_unique<std::atomic<int64_t>[]>(4 * n);
  for (const auto k : c10::irange(4 * n)) {
    lane_cell_ns_[k].store(0, std::memory_order_relaxed);
  }
  // Only this process's partitions become Stages: the others run in other
  // processes (gpipe::dist), and are known here by their skips' routes.
  for (const auto j : c10::irange(n)) {
    stages_.push_back(
        local_[j] ? std::make_unique<Stage>(
                        static_cast<int64_t>(j),
                        partitions[j],
                        devices_[j],
                        skip_layout_)
                  : nullptr);
  }
  for (const auto l : c10::irange(placement_.lanes())) {
    const auto stages = placement_.stages_of(l);
    bool here = false;
    for (const auto j : stages) {
      here = here || local_[j];
    }
    if (!here) {
      lanes_.push_back(nullptr);
      continue;
    }
    const auto& device = devices_[stages.front()];
    backward_inline_ = backward_inline_ || device.is_cuda();
    lanes_.push_back(
        std::make_unique<Lane>(lane_init(device, threads_per_lane)));
  }
}

Plan Pipeline::on_lanes(Plan flat) const {
  if (placement_ == Placement::modulo(size())) {
    return flat;
  }
  return fold_onto_lanes(flat, placement_);
}

void Pipeline::check_training_plan(const Plan& plan, int64_t m) const {
  if (plan.stages != size() ||
      static_cast<int64_t>(plan.lanes.size()) != lanes()) {
    // Rows without actions, where a blank line of a CSV may have made one.
    std::string empty;
    int64_t rows = 0;
    for (const auto l : c10::irange(plan.lanes.size())) {
      if (plan.lanes[l].empty()) {
        empty += (rows++ == 0 ? "" : ", ") + std::to_string(l);
      }
    }
    TORCH_CHECK_VALUE(
        false,
        "train_step: the plan has ",
        count_of(plan.stages, "stage", "stages"),
        " on ",
        count_of(static_cast<int64_t>(plan.lanes.size()), "lane", "lanes"),
        ", but the pipeline has ",
        count_of(size(), "partition", "partitions"),
        " on ",
        count_of(lanes(), "lane", "lanes"),
        rows == 0   ? ""
        : rows == 1 ? " (lane "
                    : " (lanes ",
        empty,
        rows == 0 ? ""
                  : " of the plan list no action; in a plan's CSV a blank "
                    "line between rows is an empty lane)");
  }
  TORCH_CHECK_VALUE(
      plan.micro_batches == m,
      "train_step: the plan is for ",
      count_of(plan.micro_batches, "micro-batch", "micro-batches"),
      ", but the mini-batch was cut into ",
      m,
      " (chunks, or fewer when the batch has fewer rows)");
  plan.validate();
  TORCH_CHECK_VALUE(
      plan.placement.empty() || plan.placement == placement_,
      "train_step: the plan's placement is ",
      to_string(plan.placement),
      ", but the pipeline's is ",
      to_string(placement_));
  for (const auto l : c10::irange(plan.lanes.size())) {
    for (const auto& c : plan.lanes[l]) {
      TORCH_CHECK_VALUE(
          placement_.lane_of(c.partition) == static_cast<int64_t>(l),
          "train_step: the plan runs stage ",
          c.partition,
          " on lane ",
          l,
          ", but the pipeline's placement ",
          to_string(placement_),
          " runs it on lane ",
          placement_.lane_of(c.partition));
    }
  }
  int64_t forwards = 0;
  int64_t backwards = 0;
  for (const auto& row : plan.lanes) {
    for (const auto& c : row) {
      forwards += c.phase == Phase::Forward ? 1 : 0;
      backwards += c.phase == Phase::Backward ||
                           c.phase == Phase::BackwardInput ||
                           c.phase == Phase::BackwardWeight
                       ? 1
                       : 0;
    }
  }
  TORCH_CHECK_VALUE(
      m == 0 || (forwards > 0 && backwards > 0),
      "train_step: expected a plan with every forward and every backward, "
      "but it has ",
      count_of(forwards, "forward", "forwards"),
      " and ",
      count_of(backwards, "backward action", "backward actions"));
}

std::shared_ptr<const Plan> Pipeline::training_plan(
    Schedule schedule, int64_t m) {
  std::lock_guard<std::mutex> lock(plan_mutex_);
  if (!planned_ || planned_schedule_ != schedule ||
      planned_->micro_batches != m) {
    planned_ = std::make_shared<const Plan>(make_plan(schedule, m, placement_));
    planned_schedule_ = schedule;
  }
  return planned_;
}

Pipeline::~Pipeline() = default;

namespace {

// A compute phase's slot among a partition's four; -1 for the others.
int64_t compute_slot(Phase phase) {
  switch (phase) {
    case Phase::Forward:
      return 0;
    case Phase::Backward:
      return 1;
    case Phase::BackwardInput:
      return 2;
    case Phase::BackwardWeight:
      return 3;
    default:
      return -1;
  }
}

}  // namespace

double Pipeline::lane_cell_seconds(int64_t j, Phase phase) const {
  const auto slot = compute_slot(phase);
  if (slot < 0) {
    return 0.0;
  }
  return static_cast<double>(
             lane_cell_ns_[j * 4 + slot].load(std::memory_order_relaxed)) *
         1e-9;
}

void Pipeline::set_lane_cell_seconds(int64_t j, Phase phase, double seconds) {
  const auto slot = compute_slot(phase);
  if (slot >= 0) {
    lane_cell_ns_[j * 4 + slot].store(
        static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
  }
}

void Pipeline::share_threads(int64_t cores) {
  shared_cores_ = cores;
}

std::shared_ptr<const std::vector<std::vector<int64_t>>> Pipeline::threads_of(
    const Plan& plan) {
  if (shared_cores_ <= 0) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(threads_mutex_);
  for (const auto& [known, threads] : threads_cache_) {
    if (known.lanes == plan.lanes && known.stages == plan.stages &&
        known.micro_batches == plan.micro_batches) {
      return threads;
    }
  }
  std::vector<bool> cpu(plan.lanes.size(), false);
  for (const auto l : c10::irange(plan.lanes.size())) {
    const auto& row = plan.lanes[l];
    cpu[l] = !row.empty() && is_local(row.front().partition) &&
             devices_[row.front().partition].is_cpu();
  }
  auto threads = std::make_shared<const std::vector<std::vector<int64_t>>>(
      threads_of_cells(plan, cpu, shared_cores_));
  constexpr size_t kKept = 4;
  threads_cache_.insert(threads_cache_.begin(), {plan, threads});
  if (threads_cache_.size() > kKept) {
    threads_cache_.pop_back();
  }
  return threads;
}

std::unique_ptr<Transport> Pipeline::make_transport(int64_t m) const {
  if (transport_factory_) {
    return transport_factory_(m, size());
  }
  return std::make_unique<InProcessTransport>(m, size());
}

std::unique_lock<std::mutex> Pipeline::begin_pass() {
  TORCH_CHECK_VALUE(
      !inside_cell(),
      "gpipe::GPipe was called from inside a cell of a pipeline (a layer's "
      "forward or a train_step loss running on a lane): nested pipelines are "
      "not supported; run the inner model as plain layers of the outer one");
  // Note [Lanes across fork()].
  TORCH_CHECK_VALUE(
      current_process() == process_,
      "this gpipe pipeline was built in process ",
      process_,
      ", and this is process ",
      current_process(),
      ", a child made by fork(): its lanes' threads run in the parent only. "
      "Build a new GPipe in the child (its lanes are the child's own)");
  return std::unique_lock<std::mutex>(pass_mutex_);
}

std::shared_ptr<Pass> Pipeline::start_pass(
    int64_t m, const Batch& original_inputs, const PassOptions& options) {
  auto pass = std::make_shared<Pass>(*this, m, options);
  bool any_requires_grad = false;
  for (const auto& x : original_inputs) {
    any_requires_grad = any_requires_grad || x.requires_grad();
  }
  for (auto& stage : stages_) {
    if (stage) {
      stage->refresh();
      any_requires_grad = any_requires_grad || stage->trainable();
    }
  }
  pass->grad = torch::GradMode::is_enabled() && any_requires_grad;
  return pass;
}

void Pipeline::commit_batch_norms(bool ok) {
  for (auto& stage : stages_) {
    if (!stage) {
      continue;  // another process's
    }
    if (ok) {
      stage->commit_batch_norms();
    } else {
      stage->discard_batch_norms();
    }
  }
}

void Pipeline::run_and_commit(
    const std::shared_ptr<Pass>& pass, const Plan& plan, const Steps* steps) {
  try {
    pass->run(plan, /*inline_cells=*/false, pass, steps);
  } catch (...) {
    // A failed mini-batch leaves no statistics behind.
    commit_batch_norms(false);
    throw;
  }
  // The statistics of every micro-batch are in: update the running ones
  // once for the mini-batch. See gpipe/batchnorm.h.
  commit_batch_norms(true);
}

Packet Pipeline::forward(
    std::vector<Packet> inputs,
    const Batch& original_inputs,
    const PassOptions& options) {
  auto held = begin_pass();
  LocalEndpoints ends;
  ends.inputs = std::move(inputs);
  ends.originals = original_inputs;
  auto done = forward(ends, options);
  return connect_outputs(
      shared_from_this(),
      done.pass,
      std::move(done.outputs),
      original_inputs,
      std::move(done.rows));
}

namespace {

// The pass's start as this process sees it: the rows of the micro-batches
// it feeds in.
PassStart start_here(const Endpoints& ends, const PassOptions& options) {
  PassStart start;
  start.options = options;
  for (const auto& packet : ends.inputs) {
    start.rows.push_back(packet.tensors.at(0).size(0));
  }
  return start;
}

// The step seed, drawn into `seed` unless it was already: before the pass
// begins where the processes agree on it (see first_seed), else once the
// pass has passed its checks.
void draw_seed(std::optional<uint64_t>& seed, PassStart& start) {
  if (!seed && !start.seed_agreed) {
    seed = draw_step_seed();
    start.seed = *seed;
  }
}

// At a pass's start: the seed drawn into `seed` where `ends` must agree on
// it in begin(), else nothing yet.
void first_seed(
    std::optional<uint64_t>& seed, const Endpoints& ends, PassStart& start) {
  if (ends.seed_first()) {
    draw_seed(seed, start);
  }
}

}  // namespace

Pipeline::Forward Pipeline::forward(
    Endpoints& ends, const PassOptions& options) {
  const auto n = size();
  Forward done;
  {
    auto start = start_here(ends, options);
    std::optional<uint64_t> seed;
    first_seed(seed, ends, start);
    ends.begin(start);
    const auto m = static_cast<int64_t>(start.rows.size());
    done.pass = start_pass(m, ends.originals, start.options);
    draw_seed(seed, start);
    done.pass->step_seed = start.seed;
    ends.prepare(*done.pass);
    if (is_local(0)) {
      for (const auto i : c10::irange(m)) {
        done.pass->transport().send(
            Phase::Forward, i, 0, std::move(ends.inputs.at(i)));
      }
    }
    run_and_commit(done.pass, ends.arrange(on_lanes(forward_plan(m, n))));
    done.rows = std::move(start.rows);
  }
  if (is_local(n - 1)) {
    for (const auto i : c10::irange(done.rows.size())) {
      done.outputs.push_back(done.pass->transport().recv(Phase::Forward, i, n));
    }
  }
  ends.end(*done.pass);
  return done;
}

void Pipeline::backward(const std::shared_ptr<Pass>& pass) {
  pass->run(
      on_lanes(backward_plan(pass->micro_batches(), size())),
      backward_inline_,
      pass);
}

torch::Tensor Pipeline::train(
    std::vector<Packet> inputs,
    std::vector<torch::Tensor> targets,
    const Batch& original_inputs,
    const LossFunction& loss_fn,
    const Plan& plan,
    const PassOptions& options) {
  auto held = begin_pass();
  LocalEndpoints ends;
  ends.inputs = std::move(inputs);
  ends.originals = original_inputs;
  ends.training_plan = &plan;
  ends.micro_targets = std::move(targets);
  return train(ends, loss_fn, options, held);
}

torch::Tensor Endpoints::loss(Pass& pass) {
  return torch::stack(pass.losses).sum();
}

// Checking a plan costs more than comparing it with the one checked last.
void Pipeline::check_training_plan_once(const Plan& plan, int64_t m) {
  if (plan.micro_batches != m || plan.stages != checked_plan_.stages ||
      plan.micro_batches != checked_plan_.micro_batches ||
      plan.lanes != checked_plan_.lanes ||
      !(plan.placement == checked_plan_.placement)) {
    check_training_plan(plan, m);
    checked_plan_ = plan;
    checked_steps_ = plan.steps();
  }
}

torch::Tensor Pipeline::train(
    Endpoints& ends,
    const LossFunction& loss_fn,
    const PassOptions& options,
    std::unique_lock<std::mutex>& held) {
  const auto n = size();
  std::shared_ptr<Pass> pass;
  std::vector<int64_t> rows;
  {
    auto start = start_here(ends, options);
    std::optional<uint64_t> seed;
    first_seed(seed, ends, start);
    ends.begin(start);
    const auto m = static_cast<int64_t>(start.rows.size());
    const auto& plan = ends.plan(start);
    try {
      check_training_plan_once(plan, m);
    } catch (...) {
      ends.refuse(std::current_exception());
    }
    auto targets = ends.targets(start);
    pass = start_pass(m, ends.originals, start.options);
    ends.prepare(*pass);
    TORCH_CHECK_VALUE(
        torch::GradMode::is_enabled(),
        "train_step needs grad mode on, but it is off here (under "
        "torch::NoGradGuard or c10::InferenceMode); use forward for "
        "inference");
    // A frozen model's loss may still read a tensor to train (a
    // temperature): whether the step trains anything, Stage::loss says.
    pass->grad = true;
    draw_seed(seed, start);
    pass->step_seed = start.seed;
    if (is_local(n - 1)) {
      pass->train_with(loss_fn, std::move(targets), start.rows);
    }
    if (is_local(0)) {
      for (const auto i : c10::irange(m)) {
        pass->transport().send(
            Phase::Forward, i, 0, std::move(ends.inputs.at(i)));
      }
    }
    // `plan` equals checked_plan_ (compared above): its steps are kept.
    run_and_commit(pass, plan, &checked_steps_);
    rows = std::move(start.rows);
  }
  auto loss = ends.loss(*pass);
  std::vector<Packet> dx;
  if (is_local(0)) {
    for (const auto i : c10::irange(rows.size())) {
      dx.push_back(pass->transport().recv(Phase::Backward, i, 0));
    }
  }
  ends.end(*pass);
  // Gradients of inputs that require grad continue into their graph, which
  // may hold this very pipeline's output: let go of the pipeline first.
  held.unlock();
  const auto& originals = ends.originals;
  for (const auto k : c10::irange(originals.size())) {
    const auto& x = originals[k];
    if (!x.requires_grad()) {
      continue;
    }
    auto g = join_input_grad(dx, k, rows, x.sizes().vec(), x.options());
    if (g.defined()) {
      torch::autograd::backward({x}, {g});
    }
  }
  return loss;
}

}  // namespace gpipe::detail
