// The loss cell of a training step's last stage, and how its graph joins
// the stage's backward.

#include <gpipe/checkpoint.h>
#include <gpipe/trace.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/cell.h"
#include "engine/stage.h"

namespace gpipe::detail {

torch::Tensor Stage::loss_of(
    const torch::Tensor& y, const CellContext& ctx) const {
  auto loss = (*ctx.loss_fn)(y, ctx.target);
  TORCH_CHECK_VALUE(
      loss.defined(),
      "train_step expects loss_fn to return a scalar, but it returned an "
      "undefined tensor");
  TORCH_CHECK_VALUE(
      loss.numel() == 1,
      "train_step expects loss_fn to return a scalar, but it returned a "
      "tensor of shape ",
      loss.sizes());
  // A 0-dim loss needs no reshape (and its backward no extra node).
  return (loss.dim() == 0 ? loss : loss.reshape({})) * ctx.loss_scale;
}

// Note [The loss and the last stage's backward]
// The plain model's backward of a training step starts at the loss and runs
// through the last layers in one autograd engine run. The last stage's
// backward does the same: the loss is computed on the output and kept with
// its graph, and the cell's backward starts from it (with the skips'
// gradients, if any), so the loss function sees the output as the plain
// model's sees it. A cell that kept its graph gives the loss its output
// itself. A checkpointed cell has no graph to join until its backward
// recomputes the output, and its loss must not run twice (it may draw
// random numbers or have side effects): the loss gets a stand-in for the
// output whose graph ends at a junction node, and the backward, once it has
// recomputed the output, connects the junction to the output's graph before
// it starts from the loss. The loss's own parameters, if any, get their
// gradients in that backward. A loss function that runs a backward itself
// is told before any gradient reaches the model: it meets the unconnected
// junction, or, where the cell kept its graph, a hook on the output that is
// there while the loss function runs (a junction there too would cost an
// autograd node per micro-batch, which gpipe-bench's cell-cost section
// shows: docs/benchmark-history.md).
namespace {

constexpr const char* kLossRanBackward =
    "train_step's loss_fn ran a backward through the model's output "
    "(loss.backward() or torch::autograd::grad inside loss_fn); "
    "train_step runs the backward itself: return the loss without "
    "back-propagating it";

// Passes the loss's gradient of the stand-in on to the recomputed output.
// Its edge comes after the loss's nodes have made it their child, which
// Node::add_next_edge refuses, so that a node's topological number (the
// longest path to a leaf, which autograd uses to prune what cannot reach
// the requested outputs) never changes under a parent. The junction's
// number is set once, above any graph's, so that it holds whatever the
// edge leads to, and the edge is added without changing it.
struct OutputJunction final : torch::autograd::Node {
  OutputJunction() {
    topological_nr_ = uint64_t{1} << 62;
  }
  void connect(const torch::Tensor& output) {
    auto edge = torch::autograd::impl::gradient_edge(output);
    TORCH_INTERNAL_ASSERT(
        next_edges().empty() &&
        (!edge.function || edge.function->topological_nr() < topological_nr_));
    next_edges().push_back(std::move(edge));
  }
  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override {
    // Not yet connected: a backward started inside the loss function,
    // before the cell's backward (which connects it) began.
    TORCH_CHECK_VALUE(!next_edges().empty(), kLossRanBackward);
    return std::move(grads);
  }
  std::string name() const override {
    return "gpipe::OutputJunction";
  }
};

}  // namespace

void Stage::loss(CellState& c, const CellContext& ctx) {
  TORCH_INTERNAL_ASSERT(ctx.loss_fn != nullptr && c.output.tensors.size() == 1);
  CellScope scope(device_);
  const AutocastScope autocast(ctx.autocast);
  const auto started = stamp(ctx);
  const auto y = c.output.tensors[0];
  // A checkpointed output was kept for the loss only (backward recomputes).
  if (!c.has_graph || c.checkpointed) {
    c.output = Packet{};
  }
  const bool grad = c.has_graph && ctx.grad &&
                    (c.checkpointed || y.requires_grad()) &&
                    is_differentiable(y);
  auto input = grad && !c.checkpointed ? y : y.detach();
  std::shared_ptr<torch::autograd::Node> junction;
  if (grad && c.checkpointed) {
    junction = std::make_shared<OutputJunction>();
    const auto k = junction->add_input_metadata(input);
    torch::autograd::impl::set_gradient_edge(input, {junction, k});
  }
  // Refuses a backward through the output while the loss function runs.
  struct BackwardRefused {
    torch::Tensor output;
    unsigned hook = 0;
    ~BackwardRefused() {
      if (output.defined()) {
        output.remove_hook(hook);
      }
    }
  } refused;
  if (grad && !c.checkpointed) {
    refused.hook = input.register_hook([](const torch::Tensor&) {
      TORCH_CHECK_VALUE(false, kLossRanBackward);
    });
    refused.output = input;
  }
  torch::Tensor loss;
  auto body = [&] { loss = loss_of(input, ctx); };
  auto rerun = [&] {
    RecomputingGuard recomputing;
    body();
  };
  {
    torch::AutoGradMode grad_mode(ctx.grad);
    run_seeded(loss_random_, device_, ctx.training, ctx.loss_seed, body, rerun);
  }
  // The plain model's loss.backward() refuses such a loss; here the step
  // would return it and change nothing.
  TORCH_CHECK_VALUE(
      !grad || loss.requires_grad(),
      "train_step expects loss_fn to return a loss that requires grad "
      "(computed from the output), but it returned a ",
      loss.scalar_type(),
      " tensor that does not (detached, or of a dtype without gradients); "
      "the step would change nothing");
  if (ctx.grad && !loss.requires_grad()) {
    TORCH_CHECK_VALUE(
        c.has_graph,
        "train_step expects something to train, but nothing requires grad: "
        "the model's parameters are frozen (to this stage), its input needs "
        "no gradient and the loss reads no tensor that does; the step would "
        "change nothing. Use forward for inference");
    TORCH_CHECK_VALUE(
        false,
        "train_step expects loss_fn to return a loss that requires grad, but "
        "the last stage's output ",
        is_differentiable(y)
            ? std::string("does not require grad (a layer detached it, or ran "
                          "under NoGradGuard)")
            : c10::str(
                  "is a ",
                  y.scalar_type(),
                  " tensor, which carries no gradient"),
        " and the loss reads no tensor that does; the step would change "
        "nothing");
  }
  c.loss_value = loss.detach();
  // A loss that reads a tensor to train, on a frozen model's output (a
  // temperature): its backward runs from the loss alone.
  if (ctx.grad && loss.requires_grad()) {
    c.loss_root = std::move(loss);
    c.loss_junction = std::move(junction);
  }
  record(ctx, index_, TraceKind::Loss, started, CellClock::now());
}

namespace {

// Whether `loss`'s graph reaches a tensor to train other than through
// `junction` (a learnable temperature): a walk of the loss's own nodes.
bool reads_a_leaf_apart_from(
    const torch::Tensor& loss, const torch::autograd::Node* junction) {
  if (!loss.grad_fn()) {
    return loss.requires_grad();  // the loss is itself a tensor to train
  }
  std::vector<torch::autograd::Node*> stack{loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == junction || !seen.insert(node).second) {
      continue;
    }
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr) {
      return true;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) {
        stack.push_back(edge.function.get());
      }
    }
  }
  return false;
}

}  // namespace

void Stage::connect_loss(CellState& c, const Packet& y) {
  if (!c.loss_junction) {
    return;
  }
  const auto& out = y.tensors.at(0);
  // The loss of a checkpointed output was taken on a stand-in that requires
  // grad; recomputed, the output may not (a layer cut it from the graph).
  // The plain model's loss then requires grad only through the tensors the
  // loss reads itself, and without any train_step refuses it, as it does
  // where the output is not checkpointed (in loss()).
  TORCH_CHECK_VALUE(
      (out.defined() && out.requires_grad()) ||
          reads_a_leaf_apart_from(c.loss_root, c.loss_junction.get()),
      "train_step expects loss_fn to return a loss that requires grad, but "
      "the last stage's output does not require grad (a layer detached it, "
      "or ran under NoGradGuard: found when the checkpointed micro-batch was "
      "recomputed) and the loss reads no tensor that does; the step would "
      "change nothing");
  static_cast<OutputJunction&>(*c.loss_junction).connect(out);
  c.loss_junction.reset();
}

}  // namespace gpipe::detail
