#include "engine/stage.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/checkpoint.h>
#include <gpipe/trace.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <optional>

#include "engine/cell.h"
#include "engine/split_backward.h"
#include "text.h"

namespace gpipe::detail {

namespace {

// A module's own parameters, read where the module keeps them: public
// Module::parameters() copies them into a new dictionary with every name
// built again, once per pass and partition (Stage::refresh).
struct OwnParameters : torch::nn::Module {
  static const torch::OrderedDict<std::string, torch::Tensor>& of(
      const torch::nn::Module& module) {
    return module.*(&OwnParameters::parameters_);
  }
};

}  // namespace

Stage::Stage(
    int64_t index,
    torch::nn::Sequential module,
    torch::Device device,
    const SkipLayout& layout)
    : index_(index), module_(std::move(module)), device_(device) {
  for (const auto& layer : module_->children()) {
    skippables_.push_back(as_skippable(*layer));
  }
  for (const auto& m : module_->modules()) {
    if (auto* bn = m->as<DeferredBatchNormImpl>()) {
      bn->set_manual_commit(true);
      deferred_batch_norms_.push_back(bn);
    }
  }
  for (const auto& route : layout.copy_policy(index_)) {
    skips_in_.push_back(route.second);
  }
  skips_out_set_ = layout.routed_out(index_);
  skips_out_.assign(skips_out_set_.begin(), skips_out_set_.end());
}

void Stage::refresh() {
  trainable_parameters_.clear();
  auto parameters = std::make_shared<std::vector<torch::Tensor>>();
  accumulators_unheld_.clear();
  auto modes = std::make_shared<ModeSnapshot>();
  modes->modules = module_->modules();
  auto buffers = std::make_shared<std::vector<torch::Tensor>>();
  // In Module::parameters()'s order: each module's own, the module before
  // its children.
  for (const auto& m : modes->modules) {
    for (const auto& item : OwnParameters::of(*m)) {
      const auto& p = item.value();
      if (p.defined()) {
        parameters->push_back(p);
      }
      if (p.defined() && !p.requires_grad()) {
        modes->frozen.push_back(p);
      }
      if (p.defined() && p.requires_grad()) {
        trainable_parameters_.push_back(p);
        accumulators_unheld_.push_back(
            torch::autograd::impl::try_get_grad_accumulator(p) == nullptr);
      }
    }
    for (auto& b : m->buffers(/*recurse=*/false)) {
      if (b.defined()) {
        buffers->push_back(std::move(b));
      }
    }
    auto* deferred = dynamic_cast<DeferredBatchNormImpl*>(m.get());
    modes->deferred.push_back(deferred);
    modes->training.push_back(
        deferred != nullptr ? deferred->in_training() : m->is_training());
  }
  modes_ = std::move(modes);
  parameters_ = std::move(parameters);
  refresh_buffers(std::move(buffers));
}

namespace {

// The first layer of the pipeline, given the batch as GPipe's forward
// overload passed it: a torch::Tensor, or a std::vector<torch::Tensor>. A
// layer that takes the other kind throws LibTorch's "Expected argument #0
// to be of type ..."; on the first partition that is the overload's
// choice, and the error says which to call.
template <typename Call>
torch::nn::AnyValue first_layer(
    int64_t partition, const Packet& input, Call& call_layer) {
  try {
    return input.atomic ? call_layer(input.tensors.at(0))
                        : call_layer(input.tensors);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (partition != 0 ||
        what.find("Expected argument #0 to be of type") == std::string::npos) {
      throw;
    }
    TORCH_CHECK_TYPE(
        false,
        "the first layer does not take ",
        input.atomic ? "a torch::Tensor, which forward(torch::Tensor) and "
                       "forward_tuple(torch::Tensor) give it"
                     : "a std::vector<torch::Tensor>, which "
                       "forward(std::vector<torch::Tensor>) gives it",
        "; call ",
        input.atomic
            ? "forward(std::vector<torch::Tensor>)"
            : "forward(torch::Tensor), or forward_tuple(torch::Tensor) "
              "when the last layer returns a "
              "std::vector<torch::Tensor>",
        " [",
        what.substr(0, what.find('\n')),
        "]");
  }
}

}  // namespace

Packet Stage::call(const Packet& input) {
  auto it = module_->begin();
  TORCH_INTERNAL_ASSERT(it != module_->end(), "empty partition ", index_);
  size_t layer = 0;
  auto call_layer = [&](auto&& argument) {
    const Skippable* skippable = skippables_[layer++];
    if (skippable == nullptr) {
      return it->any_forward(std::forward<decltype(argument)>(argument));
    }
    SkipUsageGuard usage(skippable);
    auto output = it->any_forward(std::forward<decltype(argument)>(argument));
    usage.check();
    return output;
  };
  torch::nn::AnyValue value = first_layer(index_, input, call_layer);
  for (++it; it != module_->end(); ++it) {
    value = call_layer(std::move(value));
  }
  return packet_of(std::move(value), "partition", index_);
}

void Stage::run(
    const Packet& x,
    const std::map<SkipKey, torch::Tensor>& incoming,
    Packet& y,
    std::vector<torch::Tensor>& outgoing) {
  CellSkipTracker skips(skips_out_set_, incoming);
  {
    SkipTrackerGuard tracker(&skips);
    y = call(x);
  }
  outgoing.clear();
  for (const auto& key : skips_out_) {
    outgoing.push_back(skips.outgoing()[key]);
  }
}

Flow Stage::forward(CellState& c, Flow in, const CellContext& ctx) {
  CellScope scope(device_);
  const AutocastScope autocast(ctx.autocast);
  const auto started = stamp(ctx);
  bool copied = false;
  bool any_input_grad = false;
  auto take = [&](const torch::Tensor& t) {
    copied = copied || (t.defined() && t.device() != device_);
    auto leaf = leaf_of(t, device_, ctx.grad);
    any_input_grad = any_input_grad || (leaf.defined() && leaf.requires_grad());
    return leaf;
  };
  // A skip from an earlier stage is a leaf of this cell's graph, like the
  // boundary input.
  std::map<SkipKey, torch::Tensor> incoming;
  std::vector<torch::Tensor> skip_inputs;
  for (const auto k : c10::irange(skips_in_.size())) {
    auto leaf = take(in.skips.at(k));
    incoming.emplace(skips_in_[k], leaf);
    skip_inputs.push_back(std::move(leaf));
  }
  Packet x{{}, in.boundary.atomic};
  x.tensors.reserve(in.boundary.tensors.size());
  for (const auto& t : in.boundary.tensors) {
    x.tensors.push_back(take(t));
  }
  in = Flow{};
  auto computing = started;
  if (ctx.trace && copied) {
    computing = CellClock::now();
    record(ctx, index_, TraceKind::Copy, started, computing);
  }

  // A cell whose inputs need no gradient on a stage whose parameters need
  // none (a frozen backbone) has nothing to back-propagate: it keeps
  // nothing, is never recomputed, and its outputs require no grad, as in
  // the plain model.
  const bool graph = ctx.grad && (any_input_grad || trainable());
  c.has_graph = graph;
  c.checkpointed = graph && ctx.checkpoint;
  c.input_versions.clear();
  if (c.checkpointed) {
    c.input_versions = versions_of(skip_inputs, x.tensors);
  }
  c.seed = ctx.seed;
  c.modes = c.checkpointed ? modes_ : nullptr;
  Packet y;
  std::vector<torch::Tensor> outgoing;
  auto body = [&] { run(x, incoming, y, outgoing); };
  // A second run, when the first drew unseeded: a recomputation whose
  // results replace the first run's, side effects kept single.
  auto rerun = [&] {
    RecomputingGuard recomputing;
    BufferRestore buffers;
    buffers.save(module_->buffers());
    put_forward_buffers(c);
    body();
  };
  // What a checkpointed cell's recomputation must read of the buffers.
  c.forward_buffers.clear();
  auto buffers_then = c.checkpointed ? buffers_before_forward(c)
                                     : decltype(buffers_before_forward(c)){};
  {
    std::optional<torch::NoGradGuard> no_grad;
    std::optional<CheckpointingGuard> checkpointing;
    if (c.checkpointed) {
      no_grad.emplace();
      checkpointing.emplace();
    }
    c.random = run_seeded(random_, device_, ctx.training, c.seed, body, rerun);
  }
  if (c.checkpointed) {
    buffers_after_forward(c, buffers_then.first, buffers_then.second);
  }
  // Also in a pass without checkpoints once one ran: its forwards (an eval
  // pass between a checkpointed forward and its backward) change what the
  // layers leave too.
  if (ctx.checkpoint_in_pass || noted_.load(std::memory_order_relaxed)) {
    note_parameters_left(parameters_);
  }

  // Outputs require grad where the plain model's would: as computed, or,
  // for a checkpointed cell (computed without graph), wherever a graph
  // could reach them.
  auto needs_grad = [&](const torch::Tensor& t) {
    return graph && (c.checkpointed || (t.defined() && t.requires_grad()));
  };
  Flow out;
  out.boundary.atomic = y.atomic;
  if (ctx.loss_fn == nullptr) {
    for (const auto& t : y.tensors) {
      out.boundary.tensors.push_back(sendable(t, needs_grad(t)));
    }
  } else {
    TORCH_CHECK_TYPE(
        y.atomic && y.tensors.size() == 1,
        "train_step expects the last layer to return one tensor, but it "
        "returned ",
        y.atomic
            ? count_of(
                  static_cast<int64_t>(y.tensors.size()), "tensor", "tensors")
            : c10::str(
                  "a std::vector of ",
                  count_of(
                      static_cast<int64_t>(y.tensors.size()),
                      "tensor",
                      "tensors")));
  }
  for (const auto& t : outgoing) {
    out.skips.push_back(sendable(t, needs_grad(t)));
  }
  if (graph) {
    c.input = std::move(x);
    c.skip_inputs = std::move(skip_inputs);
    if (!c.checkpointed) {
      c.output = std::move(y);
      c.skip_outputs = std::move(outgoing);
    }
  }
  if (ctx.loss_fn != nullptr && !(graph && !c.checkpointed)) {
    c.output = std::move(y);  // for the loss only: without graph
  }
  record(ctx, index_, TraceKind::Forward, computing, CellClock::now());
  return out;
}

Flow Stage::backward(
    CellState& c, Flow dy, const CellContext& ctx, bool input_only) {
  CellScope scope(device_);
  const auto started = stamp(ctx);
  Flow dx;
  dx.boundary.atomic = c.input.atomic;
  dx.boundary.tensors.resize(c.input.tensors.size());
  dx.skips.resize(skips_in_.size());
  bool any_grad = c.loss_root.defined();
  for (const auto* grads : {&dy.boundary.tensors, &dy.skips}) {
    for (const auto& g : *grads) {
      any_grad = any_grad || g.defined();
    }
  }
  if (!any_grad || (!c.has_graph && !c.loss_root.defined())) {
    // Frozen, or no gradient reaches this cell's outputs: nothing to
    // recompute or back-propagate. (A frozen cell's loss may still read a
    // tensor to train: its backward runs from the loss.)
    if (!ctx.retain) {
      c = CellState{};
    }
    return dx;
  }

  auto backward_started = started;
  Packet y;
  std::vector<torch::Tensor> skip_outputs;
  // Recomputation must not update running statistics a second time; the
  // buffers are put back once the cell's backward, which may read them,
  // is done, also when it fails.
  BufferRestore buffers;
  if (c.checkpointed) {
    const auto now = versions_of(c.skip_inputs, c.input.tensors);
    for (const auto k : c10::irange(now.size())) {
      TORCH_CHECK_VALUE(
          now[k] == c.input_versions.at(k),
          "a checkpointed partition's input was changed in place after its "
          "forward began (its version went from ",
          c.input_versions[k],
          " to ",
          now[k],
          "): the backward recomputes the forward from that input, so the "
          "gradients would be wrong. Make the layer that changes it out of "
          "place (an in-place ReLU, a mul_ of its input), or do not "
          "checkpoint (Checkpoint::Never)");
    }
    // (The list checked, not parameters_: a backward runs outside its
    // pass, while another pass may refresh.)
    const auto checked = check_parameters_unchanged();
    // A backward called inside c10::InferenceMode runs (the plain model's
    // does); the recomputation must build a graph all the same.
    c10::InferenceMode not_inference(/*enabled=*/false);
    torch::AutoGradMode grad_mode(true);
    const AutocastScope autocast(ctx.autocast);  // the forward's
    RecomputingGuard recomputing;
    buffers.save(module_->buffers());
    std::map<SkipKey, torch::Tensor> incoming;
    for (const auto k : c10::irange(skips_in_.size())) {
      incoming.emplace(skips_in_[k], c.skip_inputs[k]);
    }
    try {
      ModeRestore modes(c.modes.get());
      // From the buffers as the forward read them, each time it runs.
      replay_seeded(device_, c.seed, c.random, [&] {
        put_forward_buffers(c);
        run(c.input, incoming, y, skip_outputs);
      });
    } catch (...) {
      failed_in_recomputation() = true;
      throw;
    }
    note_parameters_left(checked);
    connect_loss(c, y);
    if (ctx.trace) {
      backward_started = CellClock::now();
      record(ctx, index_, TraceKind::Recompute, started, backward_started);
    }
  } else {
    y = c.output;
    skip_outputs = c.skip_outputs;
  }

  std::vector<torch::Tensor> roots;
  std::vector<torch::Tensor> grads;
  auto add_root = [&](const torch::Tensor& out, const torch::Tensor& g) {
    if (g.defined() && out.defined() && out.requires_grad()) {
      roots.push_back(out);
      grads.push_back(g.device() == out.device() ? g : g.to(out.device()));
    }
  };
  for (const auto k : c10::irange(y.tensors.size())) {
    if (k < dy.boundary.tensors.size()) {
      add_root(y.tensors[k], dy.boundary.tensors[k]);
    }
  }
  if (c.loss_root.defined()) {
    add_root(c.loss_root, torch::ones_like(c.loss_root));
  }
  // The gradients of skips to later stages came back from the cells that
  // popped them.
  for (const auto k : c10::irange(skip_outputs.size())) {
    if (k < dy.skips.size()) {
      add_root(skip_outputs[k], dy.skips[k]);
    }
  }
  // A checkpointed cell's outputs, computed without a graph, said they
  // need grad; recomputed, none that a gradient came to does (a layer cut
  // them: a detach(), a no-grad section). The plain model's output needed
  // none, and its backward() fails: so does this one, rather than return
  // having trained nothing.
  TORCH_CHECK_VALUE(
      !(c.checkpointed && ctx.last_stage && roots.empty()),
      "backward() reached the pipeline's output, which does not require "
      "grad: recomputed for the backward, the last partition's layers cut "
      "it from the graph (a detach(), or a layer run under no grad). The "
      "plain model's backward() fails here too (its output does not require "
      "grad); a checkpointed micro-batch's output can tell only once it is "
      "recomputed");
  dy = Flow{};
  skip_outputs.clear();
  // Input leaves of a retained cell collect gradients again on the next
  // backward: start from nothing each time.
  for (auto* leaves : {&c.input.tensors, &c.skip_inputs}) {
    for (auto& x : *leaves) {
      if (x.defined() && x.grad().defined()) {
        x.mutable_grad().reset();
      }
    }
  }
  if (input_only) {
    std::vector<torch::Tensor> leaves = c.skip_inputs;
    leaves.insert(leaves.end(), c.input.tensors.begin(), c.input.tensors.end());
    auto grads_in = backward_input(roots, grads, leaves, c.weight);
    roots.clear();
    grads.clear();
    y = Packet{};
    buffers.restore();
    for (const auto k : c10::irange(skips_in_.size())) {
      dx.skips[k] = std::move(grads_in[k]);
    }
    for (const auto k : c10::irange(c.input.tensors.size())) {
      dx.boundary.tensors[k] = std::move(grads_in[skips_in_.size() + k]);
    }
    auto weight = std::move(c.weight);
    c = CellState{};
    c.weight = std::move(weight);
    record(
        ctx, index_, TraceKind::Backward, backward_started, CellClock::now());
    return dx;
  }
  if (!roots.empty()) {
    torch::autograd::backward(
        roots, grads, /*retain_graph=*/ctx.retain, /*create_graph=*/false);
  }
  roots.clear();
  grads.clear();
  y = Packet{};
  buffers.restore();

  auto grad_of = [](const torch::Tensor& leaf) {
    return leaf.defined() && leaf.requires_grad() ? leaf.grad()
                                                  : torch::Tensor();
  };
  for (const auto k : c10::irange(skips_in_.size())) {
    dx.skips[k] = grad_of(c.skip_inputs[k]);
  }
  for (const auto k : c10::irange(c.input.tensors.size())) {
    dx.boundary.tensors[k] = grad_of(c.input.tensors[k]);
  }
  if (!ctx.retain) {
    c = CellState{};
  }
  record(ctx, index_, TraceKind::Backward, backward_started, CellClock::now());
  return dx;
}

void Stage::backward_weight(CellState& c, const CellContext& ctx) {
  CellScope scope(device_);
  const auto started = stamp(ctx);
  auto weight = std::move(c.weight);
  c = CellState{};
  if (weight) {
    detail::backward_weight(*weight, /*retain=*/false);
    weight.reset();
  }
  record(ctx, index_, TraceKind::Weight, started, CellClock::now());
}

void Stage::commit_batch_norms() {
  for (auto* bn : deferred_batch_norms_) {
    bn->commit();
  }
}

void Stage::discard_batch_norms() {
  for (auto* bn : deferred_batch_norms_) {
    bn->discard();
  }
}

}  // namespace gpipe::detail
