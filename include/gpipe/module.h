#pragma once

#include <gpipe/options.h>
#include <gpipe/plan.h>
#include <gpipe/schedule.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace gpipe {

class Trace;

/// GPipe pipeline parallelism over a `torch::nn::Sequential`.
///
/// The Sequential's layers are split into partitions (`balance` layers each),
/// each partition placed on its device and run by its own worker lane; every
/// mini-batch is cut into `chunks` micro-batches that flow through the
/// partitions like an assembly line, forward and backward. Outputs and
/// gradients equal those of the plain Sequential. An empty Sequential with
/// `balance` {} passes its input through, as torchgpipe's does (the plain
/// Sequential's forward throws); `train_step` refuses it.
///
/// Parameters are registered under `partitions.<j>.<name>`, where `<name>` is
/// the layer's name in the Sequential. gpipe/serialize.h reads archives of
/// the plain model into a GPipe of any balance and back. The GPipe uses the
/// Sequential's layers in place: training it trains the Sequential.
///
/// Example:
/// ```
/// gpipe::GPipe model(net, gpipe::GPipeOptions({2, 2}).chunks(4));
/// auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
/// loss.backward();
/// ```
class GPipeImpl : public torch::nn::Module {
 public:
  GPipeImpl(torch::nn::Sequential module, GPipeOptions options);
  ~GPipeImpl() override;

  /// As Module::train, and on the Sequential given, whose layers these are
  /// (`eval()` is `train(false)`).
  void train(bool on = true) override;

  /// Runs a single-tensor batch through the pipeline. The output is on
  /// `devices().back()`; the input may be anywhere.
  torch::Tensor forward(torch::Tensor input);

  /// Runs a tuple batch: every tensor is cut into micro-batches along dim 0,
  /// and the first layer receives a `std::vector<torch::Tensor>`.
  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> inputs);

  /// Runs a single-tensor batch through a pipeline whose last layer returns
  /// a `std::vector<torch::Tensor>` (as `net->forward<std::vector<
  /// torch::Tensor>>(x)` on the Sequential): the first layer receives a
  /// `torch::Tensor`, and the outputs' micro-batches are gathered each.
  std::vector<torch::Tensor> forward_tuple(torch::Tensor input);

  /// One training step with the loss inside the pipeline: each micro-batch's
  /// loss `loss_fn(output, target)` is computed on the last partition as
  /// soon as its forward is done, and backward runs in the order `schedule`
  /// gives (`OneFOneB` starts a micro-batch's backward as soon as its loss
  /// is known, so partition j keeps at most n - j micro-batches of
  /// activations instead of all of them). `target` is cut into
  /// micro-batches like `input` and moved to the last device. `loss_fn`
  /// must be a mean over its micro-batch's rows: each micro-batch's loss is
  /// weighted by its share of the batch's rows, so the gradients
  /// accumulated into `.grad` equal those of
  /// `loss_fn(forward(input), target).backward()`. A loss that divides by
  /// something else (`cross_entropy` with ignored targets or class weights)
  /// does not give those: docs/guide.md, section 5, shows how to write it.
  /// Returns that loss (detached, on the last device). `loss_fn` runs once per
  /// micro-batch (never again in a recomputation), on the last partition's
  /// lane, seeded per micro-batch like a cell. A step that throws (a layer, or
  /// the loss of a later micro-batch) after some backwards ran, as 1F1B,
  /// interleaved and zero-bubble run them before the last loss, leaves
  /// those micro-batches' gradients in `.grad` (where `loss.backward()` on
  /// the plain model would have added nothing): call `zero_grad()` before
  /// the next step. DeferredBatchNorm statistics are left as they were;
  /// other buffers (a plain BatchNorm's running statistics) keep what the
  /// forwards that ran wrote, as in the plain model.
  torch::Tensor train_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      Schedule schedule = Schedule::FillDrain);

  /// The same with a plan of one's own (`gpipe::make_plan`, or written by
  /// hand, or `Plan::from_csv`): each lane runs its row exactly as
  /// written. The plan must have `partitions().size()` stages on `lanes()`
  /// lanes, each stage on its lane of `placement()` (a plan that carries a
  /// placement carries this one), one micro-batch per piece the
  /// batch is cut into, a forward for every cell and a whole or split
  /// backward for every cell, every loss or none (then each follows its
  /// forward), and must run (`Plan::validate`); otherwise
  /// `c10::ValueError` says what differs.
  torch::Tensor train_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      const Plan& plan);

  /// A new GPipe of a copy of the Sequential given (`Sequential::clone`:
  /// every layer must be cloneable; parameters, buffers and training modes
  /// copied, on the same devices), with the layout as built and this one's
  /// chunks, checkpoint and training mode. `device` must be unset: the
  /// partitions' devices are the options'.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;

  /// Refused: GPipe owns device placement.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false)
      override;
  /// Casts every partition to `dtype` on its own device.
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// Refused: GPipe owns device placement.
  void to(torch::Device device, bool non_blocking = false) override;

  /// Records every cell of later passes into `trace` (see gpipe/trace.h);
  /// nullptr stops recording. Call between steps: a forward's backward
  /// (`loss.backward()`, recomputations included) records into the trace
  /// its forward had. Two models recording into one trace share its lane
  /// numbers; give each its own trace to tell them apart.
  void set_trace(std::shared_ptr<Trace> trace);
  /// The trace being recorded into, or nullptr.
  std::shared_ptr<Trace> trace() const;

  /// `gpipe::GPipe(balance=[2, 2], chunks=4, checkpoint=except_last)`.
  void pretty_print(std::ostream& stream) const override;

  /// Number of layers of each partition, as built.
  const std::vector<int64_t>& balance() const {
    return built_.balance();
  }
  /// Partitions per lane, as built (`options.stages_per_lane()`).
  int64_t stages_per_lane() const {
    return built_.stages_per_lane();
  }
  /// Device of each partition (one per partition).
  const std::vector<torch::Device>& devices() const {
    return devices_;
  }
  /// Number of lanes: those of `placement()`.
  int64_t lanes() const;
  /// Which lane runs each partition: `options.placement()`, or
  /// `Placement::modulo(partitions / stages_per_lane, stages_per_lane)`.
  Placement placement() const;
  /// Number of micro-batches per mini-batch.
  int64_t chunks() const {
    return options.chunks();
  }
  /// Checkpoint mode.
  Checkpoint checkpoint() const {
    return options.checkpoint();
  }
  /// Intra-op threads of each CPU lane when every lane is busy (the count
  /// it runs with throughout, unless threads_follow_plan()).
  int64_t threads_per_lane() const {
    return threads_per_lane_;
  }
  /// True when the CPU lanes share the machine's cores by the plan (the
  /// default, threads_per_lane 0, with more cores than CPU lanes' threads):
  /// in a plan that never runs two CPU lanes at once (every plan at chunks
  /// 1) each cell takes every core; other plans' cells take
  /// threads_per_lane().
  bool threads_follow_plan() const {
    return threads_follow_plan_;
  }
  /// The partitions, each a Sequential of its layers.
  const torch::nn::ModuleList& partitions() const {
    return partitions_;
  }
  /// Total number of layers.
  int64_t size() const;
  /// Layer `index` across partitions; negative indices count from the end.
  std::shared_ptr<torch::nn::Module> operator[](int64_t index) const;

  /// The options it was built with (`balance`, `chunks`, ...). `chunks`
  /// and `checkpoint` may be changed between passes; the layout (balance,
  /// devices, stages_per_lane, placement, threads_per_lane,
  /// deferred_batch_norm) is fixed: a pass after it was changed here is
  /// refused with a c10::ValueError naming the change.
  GPipeOptions options;

 private:
  torch::Tensor run_train_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      const Schedule* schedule,
      const Plan* plan);

  // The options as built: the layout the partitions have.
  GPipeOptions built_;
  torch::nn::ModuleList partitions_;
  // The Sequential given (its layers are the partitions'), not registered:
  // train() and eval() reach its own flag too.
  torch::nn::Sequential sequential_;
  std::vector<torch::Device> devices_;
  int64_t threads_per_lane_ = 1;
  bool threads_follow_plan_ = false;
  // The engine (src/engine/), opaque to users.
  struct Engine;
  std::shared_ptr<Engine> pipeline_;
};

/// A `ModuleHolder` for `GPipeImpl`.
TORCH_MODULE(GPipe);

}  // namespace gpipe
