#include "engine/split_backward.h"

#include <c10/util/ScopeExit.h>
#include <c10/util/irange.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace gpipe::detail {

// Note [Splitting a backward]
// The autograd graph of a cell runs from its roots (outputs and skips)
// to leaves: the cell's inputs and the parameters. Call the nodes from
// which some input can be reached the input paths. The input part runs the
// engine from the roots with the inputs' edges as outputs: the engine runs
// only the input paths, and a node on them computes only the gradients its
// input-path edges need (task_should_compute_output), so a Linear's
// AddmmBackward computes dX and not dW. A node on the input paths with an
// edge leaving them (towards parameters only) is a fork; the input part
// also captures the gradients arriving at every fork. It keeps the graph
// (the forks' saved tensors are the weight part's), but a node on the input
// paths that is not a fork frees its saved tensors as soon as it has run,
// through a post-hook, as a whole backward frees them: so what only the
// input part needs (a GELU's input, a dropout's mask) does not outlive it,
// and a micro-batch waiting for its weight part holds only the forks'
// inputs and captured gradients. Held until the input part's end, those
// tensors put zero-bubble's first lane above 1F1B's peak.
//
// The weight part then runs, per fork, the engine from the fork with its
// captured gradients and its leaving edges as outputs (the fork computes
// only those: dW). When nothing beyond the fork can be reached from
// elsewhere (another fork, a root off the input paths), the engine runs
// from those edges at once, accumulating into the parameters, so that each
// dW is freed before the next fork computes its own, as in a whole
// backward (holding every dW of a cell until the end costs fresh pages for
// each, and page faults cost more than the products here). The edges of
// the other forks wait for one last run, with the roots that were not on
// the input paths. No node runs twice.
//
// That fails in one case: when a node beyond one fork can also be reached
// from another fork below it (the same bias used by two layers of the cell,
// added to both directly), the first fork's run would also run the second
// fork. The graph is not split then: the input part runs the whole
// backward, and the weight part has nothing to do.

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct WeightWork {
  struct Fork {
    std::shared_ptr<Node> node;
    edge_list inputs;     // (node, k) for each captured gradient
    variable_list grads;  // gradients arriving at the node
    edge_list leaving;    // its edges off the input paths
    bool alone = false;   // nothing beyond it is reached from elsewhere
  };
  std::vector<Fork> forks;
  // Roots off the input paths, and their gradients.
  edge_list roots;
  variable_list grads;
};

namespace {

// Frees its node's saved tensors as soon as the node has run (what the
// engine does for every node when it does not keep the graph).
struct ReleaseAfterRun final : torch::autograd::FunctionPostHook {
  explicit ReleaseAfterRun(Node* node) : node(node) {}
  variable_list operator()(
      const variable_list& outputs, const variable_list& /*inputs*/) override {
    node->release_variables();
    return outputs;
  }
  Node* node;
};

torch::autograd::Engine& engine() {
  return torch::autograd::Engine::get_default_engine();
}

// Every node reachable from `starts`, in an order where a node comes after
// all nodes it points to (post-order).
std::vector<Node*> post_order(const std::vector<Node*>& starts) {
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<std::pair<Node*, size_t>> stack;
  for (auto* start : starts) {
    if (start == nullptr || !seen.insert(start).second) {
      continue;
    }
    stack.emplace_back(start, 0);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->num_outputs()) {
        auto* child = node->next_edge(next++).function.get();
        if (child != nullptr && seen.insert(child).second) {
          stack.emplace_back(child, 0);
        }
        continue;
      }
      order.push_back(node);
      stack.pop_back();
    }
  }
  return order;
}

}  // namespace

std::vector<torch::Tensor> backward_input(
    const std::vector<torch::Tensor>& roots,
    const std::vector<torch::Tensor>& grads,
    const std::vector<torch::Tensor>& leaves,
    std::shared_ptr<WeightWork>& weight) {
  weight.reset();
  std::vector<torch::Tensor> dx(leaves.size());
  if (roots.empty()) {
    return dx;
  }
  edge_list root_edges;
  std::vector<Node*> starts;
  for (const auto& r : roots) {
    root_edges.push_back(torch::autograd::impl::gradient_edge(r));
    starts.push_back(root_edges.back().function.get());
  }
  edge_list leaf_edges;
  std::vector<size_t> leaf_index;  // into leaves
  std::unordered_set<Node*> leaf_nodes;
  for (const auto k : c10::irange(leaves.size())) {
    const auto& x = leaves[k];
    if (x.defined() && x.requires_grad()) {
      leaf_edges.push_back(torch::autograd::impl::gradient_edge(x));
      leaf_index.push_back(k);
      leaf_nodes.insert(leaf_edges.back().function.get());
    }
  }

  // The input paths: nodes from which a leaf can be reached.
  const auto order = post_order(starts);
  std::unordered_set<Node*> on_path;
  for (auto* node : order) {
    if (leaf_nodes.count(node) > 0) {
      continue;
    }
    for (const auto& e : node->next_edges()) {
      auto* child = e.function.get();
      if (child != nullptr &&
          (leaf_nodes.count(child) > 0 || on_path.count(child) > 0)) {
        on_path.insert(node);
        break;
      }
    }
  }
  auto work = std::make_shared<WeightWork>();
  edge_list input_roots;
  variable_list input_grads;
  for (const auto k : c10::irange(roots.size())) {
    auto* f = root_edges[k].function.get();
    if (on_path.count(f) > 0 || leaf_nodes.count(f) > 0) {
      input_roots.push_back(root_edges[k]);
      input_grads.push_back(grads[k]);
    } else {
      work->roots.push_back(root_edges[k]);
      work->grads.push_back(grads[k]);
    }
  }
  // The forks, and which fork reaches each node off the paths.
  std::unordered_map<Node*, std::unordered_set<size_t>> reached_by;
  for (auto* node : order) {
    if (on_path.count(node) == 0) {
      continue;
    }
    WeightWork::Fork fork;
    for (const auto& e : node->next_edges()) {
      auto* child = e.function.get();
      if (child != nullptr && on_path.count(child) == 0 &&
          leaf_nodes.count(child) == 0) {
        fork.leaving.push_back(e);
      }
    }
    if (fork.leaving.empty()) {
      continue;
    }
    std::vector<Node*> beyond;
    for (const auto& e : fork.leaving) {
      beyond.push_back(e.function.get());
    }
    for (auto* n : post_order(beyond)) {
      reached_by[n].insert(work->forks.size());
    }
    fork.node = node->shared_from_this();
    work->forks.push_back(std::move(fork));
  }
  bool splittable = true;
  for (const auto& fork : work->forks) {
    for (const auto& e : fork.leaving) {
      splittable = splittable && reached_by[e.function.get()].size() == 1;
    }
  }
  // Which forks have what lies beyond them to themselves (the roots off
  // the input paths count as one more fork).
  std::vector<Node*> off_path_roots;
  for (const auto& e : work->roots) {
    off_path_roots.push_back(e.function.get());
  }
  for (auto* n : post_order(off_path_roots)) {
    reached_by[n].insert(work->forks.size());
  }
  std::vector<bool> shared(work->forks.size(), false);
  for (const auto& entry : reached_by) {
    if (entry.second.size() > 1) {
      for (const auto f : entry.second) {
        if (f < shared.size()) {
          shared[f] = true;
        }
      }
    }
  }
  for (const auto f : c10::irange(work->forks.size())) {
    work->forks[f].alone = !shared[f];
  }
  if (!splittable) {
    // See the Note: the whole backward now, into .grad and the leaves.
    torch::autograd::backward(roots, grads);
    for (const auto k : c10::irange(leaves.size())) {
      const auto& x = leaves[k];
      dx[k] = x.defined() && x.requires_grad() ? x.grad() : torch::Tensor();
    }
    return dx;
  }

  // See the Note: the input paths' nodes other than the forks free their
  // saved tensors as they run; any the input part did not run, after it.
  std::unordered_set<Node*> forks;
  for (const auto& fork : work->forks) {
    forks.insert(fork.node.get());
  }
  std::vector<std::pair<Node*, uintptr_t>> hooks;
  for (auto* node : on_path) {
    if (forks.count(node) == 0) {
      hooks.emplace_back(
          node, node->add_post_hook(std::make_unique<ReleaseAfterRun>(node)));
    }
  }
  // The hooks come off once the engine has returned. When it throws, a
  // device thread may still be finishing a node of the failed run and
  // reading its hooks: they stay then (those nodes never run again, and
  // the cell is dropped); the saved tensors go either way
  // (release_variables takes the node's lock).
  bool returned = true;  // false only while the engine runs
  auto unhook = c10::make_scope_exit([&] {
    for (const auto& [node, key] : hooks) {
      if (returned) {
        node->del_post_hook(key);
      }
      node->release_variables();
    }
  });
  if (!input_roots.empty() && (!leaf_edges.empty() || !work->forks.empty())) {
    edge_list outputs = leaf_edges;
    for (auto& fork : work->forks) {
      for (const auto k : c10::irange(fork.node->num_inputs())) {
        fork.inputs.emplace_back(fork.node, static_cast<uint32_t>(k));
        outputs.push_back(fork.inputs.back());
      }
    }
    returned = false;
    auto captured = engine().execute(
        input_roots,
        input_grads,
        /*keep_graph=*/true,
        /*create_graph=*/false,
        /*accumulate_grad=*/false,
        outputs);
    returned = true;
    for (const auto k : c10::irange(leaf_edges.size())) {
      dx[leaf_index[k]] = captured[k];
    }
    size_t next = leaf_edges.size();
    for (auto& fork : work->forks) {
      edge_list inputs;
      for (auto& e : fork.inputs) {
        auto g = captured[next++];
        if (g.defined()) {
          inputs.push_back(std::move(e));
          fork.grads.push_back(std::move(g));
        }
      }
      fork.inputs = std::move(inputs);
    }
  }
  if (!work->roots.empty() || !work->forks.empty()) {
    weight = std::move(work);
  }
  return dx;
}

void backward_weight(WeightWork& work, bool retain) {
  edge_list roots = std::move(work.roots);
  variable_list grads = std::move(work.grads);
  for (auto& fork : work.forks) {
    if (fork.inputs.empty()) {
      continue;
    }
    auto leaving = engine().execute(
        fork.inputs,
        fork.grads,
        /*keep_graph=*/retain,
        /*create_graph=*/false,
        /*accumulate_grad=*/false,
        fork.leaving);
    edge_list edges;
    variable_list edge_grads;
    for (const auto k : c10::irange(fork.leaving.size())) {
      if (leaving[k].defined()) {
        edges.push_back(fork.leaving[k]);
        edge_grads.push_back(std::move(leaving[k]));
      }
    }
    leaving.clear();
    if (fork.alone && !edges.empty()) {
      engine().execute(
          edges,
          edge_grads,
          /*keep_graph=*/retain,
          /*create_graph=*/false,
          /*accumulate_grad=*/true);
      continue;
    }
    roots.insert(roots.end(), edges.begin(), edges.end());
    grads.insert(grads.end(), edge_grads.begin(), edge_grads.end());
  }
  work.forks.clear();
  if (!roots.empty()) {
    engine().execute(
        roots,
        grads,
        /*keep_graph=*/retain,
        /*create_graph=*/false,
        /*accumulate_grad=*/true);
  }
}

}  // namespace gpipe::detail
