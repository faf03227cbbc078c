#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/microbatch.h>
#include <gpipe/module.h>
#include <gpipe/skip.h>
#include <gpipe/verify.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <thread>

#include "device.h"
#include "engine/partitions.h"
#include "engine/pipeline.h"
#include "text.h"

namespace gpipe {

std::string to_string(Checkpoint checkpoint) {
  switch (checkpoint) {
    case Checkpoint::Always:
      return "always";
    case Checkpoint::ExceptLast:
      return "except_last";
    case Checkpoint::Never:
      return "never";
  }
  return "unknown";  // a cast integer, refused by every pass
}

Checkpoint checkpoint_from_string(const std::string& name) {
  if (name == "always") {
    return Checkpoint::Always;
  }
  if (name == "except_last") {
    return Checkpoint::ExceptLast;
  }
  if (name == "never") {
    return Checkpoint::Never;
  }
  TORCH_CHECK_VALUE(
      false,
      "checkpoint must be one of 'always', 'except_last' or 'never', but got '",
      name,
      "'");
}

using detail::pass_options;

struct GPipeImpl::Engine : detail::Pipeline {
  using Pipeline::Pipeline;
};

namespace {

// verify_layout_unchanged, and the Sequential's layers as many as when the
// model was built: a layer pushed back since ran nowhere (the output had
// the old last layer's shape, and the new layer's parameters were not the
// GPipe's), without a word.
void verify_built_layout(
    const GPipeOptions& options,
    const GPipeOptions& built,
    const torch::nn::Sequential& sequential) {
  detail::verify_layout_unchanged(options, built, "gpipe::GPipe");
  int64_t layers = 0;
  for (const auto b : built.balance()) {
    layers += b;
  }
  const auto now = static_cast<int64_t>(sequential->size());
  TORCH_CHECK_VALUE(
      now == layers,
      "gpipe::GPipe was built over a Sequential of ",
      detail::count_of(layers, "layer", "layers"),
      ", but it has ",
      now,
      " now: a layer added to the Sequential after the GPipe was built "
      "would not run; build a new GPipe over the Sequential as it is");
}

}  // namespace

std::shared_ptr<torch::nn::Module> GPipeImpl::clone(
    const c10::optional<torch::Device>& device) const {
  TORCH_CHECK_VALUE(
      !device.has_value(),
      "gpipe::GPipe::clone places the copy on the devices of its options; "
      "call it without a device, but got ",
      device.value_or(torch::kCPU));
  verify_built_layout(options, built_, sequential_);
  // The Sequential given, whose layers the partitions run (with
  // deferred_batch_norm its BatchNorms, whose parameters, statistics and
  // mode the converted layers share or follow): the copy converts its own
  // again, as this one did.
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(
      sequential_->clone());
  TORCH_INTERNAL_ASSERT(copy != nullptr);
  auto copy_options = built_;
  copy_options.chunks(options.chunks()).checkpoint(options.checkpoint());
  auto made = std::make_shared<GPipeImpl>(
      torch::nn::Sequential(std::move(copy)), copy_options);
  // The layers' modes came with them; a GPipe put in eval() as a whole is
  // copied as one.
  if (!is_training()) {
    made->train(false);
  }
  return made;
}

GPipeImpl::GPipeImpl(torch::nn::Sequential module, GPipeOptions options_)
    : options(std::move(options_)), built_(options), sequential_(module) {
  detail::verify_options(module, options, "gpipe::GPipe");
  if (options.deferred_batch_norm()) {
    module = convert_deferred_batch_norm(module, options.chunks());
  }
  const auto n = static_cast<int64_t>(options.balance().size());
  const auto placement = detail::placement_of(options);
  const auto lanes = placement.lanes();
  auto devices = options.devices().empty() ? detail::default_devices(lanes)
                                           : options.devices();
  verify_devices(devices, lanes);
  devices.erase(devices.begin() + lanes, devices.end());
  for (auto& d : devices) {
    d = detail::normalize_device(d);
  }
  threads_per_lane_ =
      detail::threads_per_lane(options.threads_per_lane(), devices);
  for (const auto j : c10::irange(n)) {
    devices_.push_back(devices[placement.lane_of(j)]);
  }

  // Split the layers; each keeps its name in the Sequential.
  partitions_ = register_module("partitions", torch::nn::ModuleList());
  auto parts = detail::split_partitions(module, options.balance());
  for (const auto j : c10::irange(n)) {
    parts[j]->to(devices_[j]);
    partitions_->push_back(parts[j]);
  }
  if (n > 0) {
    pipeline_ = std::make_shared<Engine>(
        std::move(parts),
        devices_,
        threads_per_lane_,
        std::vector<bool>{},
        placement);
    // Note [Threads that follow the plan] in src/engine/lane_threads.cpp.
    const auto cpu_lanes =
        std::count_if(devices.begin(), devices.end(), [](const auto& d) {
          return d.is_cpu();
        });
    if (options.threads_per_lane() == 0 && cpu_lanes > 1 &&
        detail::available_cores() > threads_per_lane_) {
      threads_follow_plan_ = true;
      pipeline_->share_threads(detail::available_cores());
    } else if (lanes == 1 && devices[0].is_cpu()) {
      // One CPU lane runs every cell alone, on the calling thread with the
      // lane's count (Note [A serial plan on the calling thread]).
      pipeline_->share_threads(threads_per_lane_);
    }
  }
  // Made of a Sequential in eval() (every layer in it), the GPipe starts in
  // eval() as a whole, so that is_training() says what its passes do. (The
  // flag is the Module's own: a net->eval() after this cannot reach it;
  // model->eval() sets both.)
  if (!sequential_->is_training() &&
      !detail::layers_training(partitions_->children(), true)) {
    train(false);
  }
}

GPipeImpl::~GPipeImpl() = default;

namespace {

// Whether a pass of `model` trains: while any of its layers does.
bool training(const GPipeImpl& model) {
  return detail::layers_training(
      model.partitions()->children(), model.is_training());
}

// The batch's micro-batches as the first partition's inputs: each one
// tensor (`atomic`, from forward(torch::Tensor)) or a tuple.
std::vector<detail::Packet> micro_packets(
    const std::vector<torch::Tensor>& inputs, int64_t chunks, bool atomic) {
  auto micro = scatter(inputs, chunks);
  std::vector<detail::Packet> packets;
  packets.reserve(micro.size());
  for (auto& b : micro) {
    packets.push_back(detail::Packet{std::move(b), atomic});
  }
  return packets;
}

// Runs a pass; an error of the first partition's forward in a pass whose
// batch is one 1-D tensor says how gpipe read it: a newcomer's one sample
// of features is cut into micro-batches of a few features each, and the
// first layer's error ("mat1 and mat2 shapes cannot be multiplied (1x4 and
// 8x4)") does not say why. (Other errors, of a batch of token ids say, are
// left as they are.)
template <typename Run>
auto with_batch_hint(
    const std::vector<torch::Tensor>& inputs, int64_t chunks, Run run) {
  try {
    return run();
  } catch (c10::Error& e) {
    const auto& where = e.context();
    const bool first_forward =
        std::any_of(where.begin(), where.end(), [](const std::string& c) {
          const std::string end = ", forward";
          return c.rfind("in gpipe partition 0, ", 0) == 0 &&
                 c.size() >= end.size() &&
                 c.compare(c.size() - end.size(), end.size(), end) == 0;
        });
    if (first_forward && inputs.size() == 1 && inputs[0].dim() == 1 &&
        chunks > 1 && inputs[0].size(0) > 1) {
      e.add_context(c10::str(
          "the input is 1-D, of shape ",
          inputs[0].sizes(),
          ": gpipe takes dimension 0 as the batch and cut it into "
          "micro-batches of its elements; if it is one sample of ",
          inputs[0].size(0),
          " features, pass input.unsqueeze(0)"));
    }
    throw;
  }
}

}  // namespace

void GPipeImpl::train(bool on) {
  torch::nn::Module::train(on);
  // The layers are the Sequential's: its own flag follows them, as
  // `net->is_training()` is what a user asks.
  sequential_->train(on);
}

torch::Tensor GPipeImpl::forward(torch::Tensor input) {
  verify_built_layout(options, built_, sequential_);
  verify_batch({input});
  if (!pipeline_) {
    return input;
  }
  auto packets = micro_packets({input}, options.chunks(), /*atomic=*/true);
  auto out = with_batch_hint({input}, options.chunks(), [&] {
    return pipeline_->forward(
        std::move(packets), {input}, pass_options(training(*this), options));
  });
  TORCH_CHECK_TYPE(
      out.atomic && out.tensors.size() == 1,
      "the last layer returned a std::vector<torch::Tensor> of ",
      detail::count_of(
          static_cast<int64_t>(out.tensors.size()), "tensor", "tensors"),
      ": call forward_tuple(torch::Tensor) for them (or forward(std::vector<"
      "torch::Tensor>) when the first layer takes one too)");
  return out.tensors[0];
}

std::vector<torch::Tensor> GPipeImpl::forward_tuple(torch::Tensor input) {
  verify_built_layout(options, built_, sequential_);
  verify_batch({input});
  if (!pipeline_) {
    return {input};
  }
  auto packets = micro_packets({input}, options.chunks(), /*atomic=*/true);
  return with_batch_hint({input}, options.chunks(), [&] {
    return pipeline_
        ->forward(
            std::move(packets), {input}, pass_options(training(*this), options))
        .tensors;
  });
}

std::vector<torch::Tensor> GPipeImpl::forward(
    std::vector<torch::Tensor> inputs) {
  verify_built_layout(options, built_, sequential_);
  verify_batch(inputs);
  if (!pipeline_) {
    return inputs;
  }
  auto packets = micro_packets(inputs, options.chunks(), /*atomic=*/false);
  return pipeline_
      ->forward(
          std::move(packets), inputs, pass_options(training(*this), options))
      .tensors;
}

void GPipeImpl::set_trace(std::shared_ptr<Trace> trace) {
  if (pipeline_) {
    pipeline_->set_trace(std::move(trace));
  }
}

std::shared_ptr<Trace> GPipeImpl::trace() const {
  return pipeline_ ? pipeline_->trace() : nullptr;
}

torch::Tensor GPipeImpl::train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    Schedule schedule) {
  return run_train_step(
      std::move(input), std::move(target), loss_fn, &schedule, nullptr);
}

torch::Tensor GPipeImpl::train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    const Plan& plan) {
  return run_train_step(
      std::move(input), std::move(target), loss_fn, nullptr, &plan);
}

torch::Tensor GPipeImpl::run_train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    const Schedule* schedule,
    const Plan* plan) {
  verify_built_layout(options, built_, sequential_);
  verify_batch({input});
  TORCH_CHECK_VALUE(
      static_cast<bool>(loss_fn), "train_step expects a loss_fn, but got none");
  TORCH_CHECK_TYPE(
      target.defined(), "train_step expects a target tensor, but got none");
  TORCH_CHECK_VALUE(
      target.dim() > 0 && target.size(0) == input.size(0),
      "train_step expects a target with the input's batch size ",
      input.size(0),
      " in dimension 0, but got shape ",
      target.sizes());
  TORCH_CHECK_VALUE(
      pipeline_ != nullptr,
      "train_step needs at least one partition, but the model is empty");
  auto micro = scatter({input}, options.chunks());
  auto targets = scatter({target.to(devices_.back())}, options.chunks());
  std::vector<detail::Packet> packets;
  std::vector<torch::Tensor> target_pieces;
  for (const auto i : c10::irange(micro.size())) {
    packets.push_back(detail::Packet{std::move(micro[i]), /*atomic=*/true});
    target_pieces.push_back(targets[i][0]);
  }
  const auto m = static_cast<int64_t>(packets.size());
  std::shared_ptr<const Plan> made;
  if (plan == nullptr) {
    made = pipeline_->training_plan(*schedule, m);
    plan = made.get();
  }
  return with_batch_hint({input}, options.chunks(), [&] {
    return pipeline_->train(
        std::move(packets),
        std::move(target_pieces),
        {input},
        loss_fn,
        *plan,
        pass_options(training(*this), options));
  });
}

int64_t GPipeImpl::lanes() const {
  return detail::placement_of(built_).lanes();
}

Placement GPipeImpl::placement() const {
  return detail::placement_of(built_);
}

void GPipeImpl::to(
    torch::Device device, torch::Dtype dtype, bool non_blocking) {
  TORCH_CHECK_TYPE(
      false,
      "gpipe::GPipe refuses to move its parameters and buffers to ",
      device,
      ": GPipe manages device placement (see devices()); cast the dtype "
      "alone with to(dtype)");
}

void GPipeImpl::to(torch::Dtype dtype, bool non_blocking) {
  for (const auto j : c10::irange(partitions_->size())) {
    partitions_[j]->to(devices_[j], dtype, non_blocking);
  }
}

void GPipeImpl::to(torch::Device device, bool non_blocking) {
  TORCH_CHECK_TYPE(
      false,
      "gpipe::GPipe refuses to move its parameters and buffers to ",
      device,
      ": GPipe manages device placement (see devices())");
}

void GPipeImpl::pretty_print(std::ostream& stream) const {
  stream << "gpipe::GPipe(balance=" << c10::IntArrayRef(built_.balance())
         << ", chunks=" << options.chunks()
         << ", checkpoint=" << to_string(options.checkpoint());
  if (!built_.placement().empty()) {
    stream << ", placement=" << to_string(built_.placement());
  } else if (built_.stages_per_lane() > 1) {
    stream << ", stages_per_lane=" << built_.stages_per_lane();
  }
  stream << ")";
}

int64_t GPipeImpl::size() const {
  int64_t total = 0;
  for (auto b : built_.balance()) {
    total += b;
  }
  return total;
}

std::shared_ptr<torch::nn::Module> GPipeImpl::operator[](int64_t index) const {
  const auto total = size();
  TORCH_CHECK_INDEX(
      total > 0,
      "layer index out of range: the model has no layers, but got ",
      index);
  TORCH_CHECK_INDEX(
      index >= -total && index < total,
      "layer index out of range: expected -",
      total,
      " <= index < ",
      total,
      ", but got ",
      index);
  if (index < 0) {
    index += total;
  }
  for (const auto& child : partitions_->children()) {
    auto part = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child);
    const auto len = static_cast<int64_t>(part->size());
    if (index < len) {
      return part->ptr(index);
    }
    index -= len;
  }
  TORCH_INTERNAL_ASSERT(false, "layer index walked past the partitions");
}

}  // namespace gpipe
