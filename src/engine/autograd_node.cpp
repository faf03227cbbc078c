#include "engine/autograd_node.h"

#include <c10/util/irange.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>

#include "engine/cell.h"
#include "engine/pipeline.h"
#include "engine/runner.h"
#include "engine/stage.h"

namespace gpipe::detail {

namespace {

// The autograd node of a GPipe output. Its backward is the pipelined
// backward of every cell of the pass that made the output.
class PipelineBackward : public torch::autograd::Node {
 public:
  struct Output {
    int64_t slot = -1;          // this node's input number, or -1: no gradient
    std::vector<int64_t> rows;  // per micro-batch
  };

  PipelineBackward(
      std::shared_ptr<Pipeline> pipeline,
      std::shared_ptr<Pass> pass,
      std::vector<Output> outputs,
      const Batch& inputs,
      std::vector<int64_t> input_rows)
      : pipeline_(std::move(pipeline)),
        pass_(std::move(pass)),
        outputs_(std::move(outputs)),
        input_rows_(std::move(input_rows)) {
    for (const auto& x : inputs) {
      inputs_.push_back(
          InputInfo{x.sizes().vec(), x.options(), x.requires_grad()});
    }
  }

  std::string name() const override {
    return "gpipe::PipelineBackward";
  }

  void release_variables() override {
    pass_.reset();
  }

  /// Note [Edges to the parameters]: how many owners each parameter edge's
  /// accumulator had once the forward was done, or -1 where a graph held
  /// it before the forward began.
  void set_parameter_uses(std::vector<long> uses) {
    parameter_uses_ = std::move(uses);
  }

  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override {
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    TORCH_CHECK(
        exec_info == nullptr || exec_info->empty(),
        "gpipe::GPipe supports only backward() over all leaves: the pipelined "
        "backward accumulates every parameter's .grad, so "
        "torch::autograd::grad (with or without allow_unused) and "
        "backward(inputs=...) through a GPipe output are not supported; call "
        "backward() and read each parameter's .grad");
    // The engine runs a node with grad mode on exactly when the backward
    // builds a graph of its own.
    TORCH_CHECK(
        !torch::GradMode::is_enabled(),
        "gpipe::GPipe does not support backward with create_graph=true "
        "(double backward, gradient penalties): its cells are separate "
        "graphs, so the gradients would carry no graph through the pipeline; "
        "call backward() without create_graph");
    TORCH_CHECK(
        pass_ && !pass_->consumed,
        "trying to backward through a gpipe::GPipe output a second time, but "
        "its saved activations have been freed; pass retain_graph=true to the "
        "first backward, or run forward again");
    auto held = pipeline_->begin_pass();
    Pass& pass = *pass_;
    const int64_t m = pass.micro_batches();
    const int64_t n = pipeline_->size();

    // The gradient of output k, cut by the rows each micro-batch gave: a
    // last layer may change dim 0 (a [B, T, V] -> [B*T, V] flatten).
    pass.reset_transport();
    std::vector<Packet> dys(m);
    for (const auto& out : outputs_) {
      const auto g = out.slot >= 0 ? grads[out.slot] : torch::Tensor();
      int64_t offset = 0;
      for (const auto i : c10::irange(m)) {
        dys[i].tensors.push_back(
            g.defined() ? g.narrow(0, offset, out.rows[i]) : torch::Tensor());
        offset += out.rows[i];
      }
    }
    for (const auto i : c10::irange(m)) {
      pass.transport().send(Phase::Backward, i, n, std::move(dys[i]));
    }
    pass.retain = torch::autograd::get_current_graph_task_keep_graph();
    if (!pass.retain) {
      cut_parameter_edges();
    }
    try {
      pipeline_->backward(pass_);
    } catch (...) {
      pass.consumed = true;
      throw;
    }
    pass.consumed = !pass.retain;

    std::vector<Packet> dx(m);
    for (const auto i : c10::irange(m)) {
      dx[i] = pass.transport().recv(Phase::Backward, i, 0);
    }
    torch::autograd::variable_list dxs;
    for (const auto k : c10::irange(inputs_.size())) {
      const auto& input = inputs_[k];
      dxs.push_back(
          input.requires_grad
              ? join_input_grad(dx, k, input_rows_, input.shape, input.options)
              : torch::Tensor());
    }
    // Nothing for the parameters' edges (see connect_outputs).
    dxs.resize(num_outputs());
    return dxs;
  }

 private:
  // Note [Edges to the parameters].
  void cut_parameter_edges() {
    auto& edges = next_edges();
    for (const auto k : c10::irange(parameter_uses_.size())) {
      auto& edge = edges[inputs_.size() + k];
      if (parameter_uses_[k] >= 0 && edge.function &&
          edge.function.use_count() == parameter_uses_[k]) {
        edge = torch::autograd::Edge();
      }
    }
  }

  std::shared_ptr<Pipeline> pipeline_;
  std::shared_ptr<Pass> pass_;
  std::vector<Output> outputs_;
  struct InputInfo {
    std::vector<int64_t> shape;
    torch::TensorOptions options;
    bool requires_grad = false;
  };
  std::vector<InputInfo> inputs_;
  std::vector<int64_t> input_rows_;
  std::vector<long> parameter_uses_;
};

// Note [Edges to the parameters]
// The node has an edge to each trainable parameter's gradient accumulator,
// though the gradients reach .grad through the cells' own graphs and the
// node gives those edges none: so that torch::autograd::grad and
// backward(inputs=...) over parameters find the node on their path and run
// it, and it refuses them. Without the edges they would stop before it,
// with LibTorch's "appears to not have been used in the graph" or, under
// allow_unused, a silently undefined gradient.
//
// A backward over every leaf then runs an empty task for each of those
// accumulators, which on small layers costs as much as the pass's own
// work. So such a backward, once it reaches the node without retain_graph
// (the edges have served), cuts the edges whose accumulator nothing but
// this pass's graphs holds: the accumulator then waits on nothing that will
// ever come, and is not run. An accumulator that something else holds may
// be waiting on a gradient from outside the pipeline in this backward (the
// parameter in a penalty term, or tied to a layer outside): its edge stays,
// so that the empty gradient given to it counts as this node's. Which ones
// nothing else holds, from the accumulator's owners: none when the pass
// began (Stage::refresh), and as many when the node runs as when the
// forward was done.

}  // namespace

torch::Tensor join_input_grad(
    const std::vector<Packet>& dx,
    size_t k,
    const std::vector<int64_t>& rows,
    std::vector<int64_t> shape,
    const torch::TensorOptions& options) {
  std::vector<torch::Tensor> pieces;
  bool any = false;
  for (const auto i : c10::irange(dx.size())) {
    const auto& tensors = dx[i].tensors;
    const auto g = k < tensors.size() ? tensors[k] : torch::Tensor();
    if (g.defined()) {
      any = true;
      pieces.push_back(g.to(options.device()));
    } else {
      shape[0] = rows[i];
      pieces.push_back(torch::zeros(shape, options));
    }
  }
  if (!any) {
    return torch::Tensor();
  }
  // One micro-batch: its gradient is the whole (a cat would copy it).
  return pieces.size() == 1 ? pieces[0] : torch::cat(pieces, 0);
}

Packet connect_outputs(
    std::shared_ptr<Pipeline> pipeline,
    std::shared_ptr<Pass> pass,
    std::vector<Packet> outputs,
    const Batch& original_inputs,
    std::vector<int64_t> input_rows) {
  const auto width = outputs.at(0).tensors.size();
  std::vector<PipelineBackward::Output> slots(width);
  std::vector<bool> needs_grad(width, false);
  std::vector<Batch> pieces;
  for (auto& packet : outputs) {
    TORCH_CHECK_VALUE(
        packet.tensors.size() == width,
        "every micro-batch must give the same number of output tensors, but "
        "one gave ",
        width,
        " and another ",
        packet.tensors.size());
    for (const auto k : c10::irange(width)) {
      auto& t = packet.tensors[k];
      TORCH_CHECK_VALUE(
          !t.defined() || t.dim() > 0,
          "gpipe joins the micro-batches' outputs along dimension 0, but the "
          "last layer returned a 0-dim tensor",
          width > 1 ? c10::str(" as output ", k) : std::string(),
          "; return one row per sample and reduce outside the model (a "
          "loss: train_step's loss_fn)");
      slots[k].rows.push_back(t.defined() && t.dim() > 0 ? t.size(0) : 0);
      // The micro-batch outputs are leaves that only carry the flag; the
      // whole outputs are what autograd sees, so cat them without a graph.
      if (t.defined() && t.requires_grad()) {
        needs_grad[k] = true;
        t = t.detach();
      }
    }
    pieces.push_back(std::move(packet.tensors));
  }
  // One micro-batch: its outputs are the whole, and a cat would only copy
  // them (detached above, so the history set below is theirs alone).
  Packet gathered{
      pieces.size() == 1 ? std::move(pieces[0]) : gather(pieces),
      outputs[0].atomic};
  if (!pass->grad) {
    return gathered;
  }
  int64_t next_slot = 0;
  for (const auto k : c10::irange(width)) {
    if (needs_grad[k] && is_differentiable(gathered.tensors[k])) {
      slots[k].slot = next_slot++;
    }
  }
  if (next_slot == 0) {
    return gathered;
  }
  // Edges to the parameters too: Note [Edges to the parameters].
  auto edges = torch::autograd::collect_next_edges(original_inputs);
  std::vector<bool> unheld;
  for (const auto j : c10::irange(pipeline->size())) {
    const auto& stage = pipeline->stage(j);
    for (const auto& p : stage.trainable_parameters()) {
      edges.push_back(torch::autograd::impl::gradient_edge(p));
    }
    const auto& fresh = stage.accumulators_unheld();
    unheld.insert(unheld.end(), fresh.begin(), fresh.end());
  }
  auto node = std::shared_ptr<PipelineBackward>(
      new PipelineBackward(
          std::move(pipeline),
          pass,
          std::move(slots),
          original_inputs,
          std::move(input_rows)),
      torch::autograd::deleteNode);
  node->set_next_edges(std::move(edges));
  std::vector<long> uses(unheld.size(), -1);
  for (const auto k : c10::irange(uses.size())) {
    const auto& edge = node->next_edge(original_inputs.size() + k);
    if (unheld[k] && edge.function) {
      uses[k] = edge.function.use_count();
    }
  }
  node->set_parameter_uses(std::move(uses));
  for (const auto k : c10::irange(width)) {
    if (needs_grad[k] && is_differentiable(gathered.tensors[k])) {
      torch::autograd::set_history(gathered.tensors[k], node);
    }
  }
  return gathered;
}

}  // namespace gpipe::detail
