// profile_layer_costs: the planner's per-layer times and bytes.

#include "balance/layer_costs.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/skip.h>
#include <torch/autograd.h>

#include <chrono>
#include <optional>
#include <unordered_set>

#include "balance/allocator.h"
#include "balance/sandbox.h"
#include "cell_generator.h"
#include "engine/lane.h"
#include "packet.h"
#include "random.h"
#include "skip.h"

namespace gpipe::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double bytes_of(const Packet& p) {
  double bytes = 0;
  for (const auto& t : p.tensors) {
    if (t.defined()) {
      bytes += static_cast<double>(t.numel() * t.element_size());
    }
  }
  return bytes;
}

// The bytes of `layer`'s parameters (each once) that need a gradient, or,
// with `trainable` false, of those that do not: a frozen parameter holds its
// value alone, no gradient and no optimizer state.
double parameter_bytes(const torch::nn::Module& layer, bool trainable) {
  std::unordered_set<const c10::TensorImpl*> seen;
  double bytes = 0;
  for (const auto& p : layer.parameters()) {
    if (p.requires_grad() == trainable &&
        seen.insert(p.unsafeGetTensorImpl()).second) {
      bytes += static_cast<double>(p.numel() * p.element_size());
    }
  }
  return bytes;
}

// Restores the intra-op thread count on the way out.
class ThreadsGuard {
 public:
  explicit ThreadsGuard(int64_t threads) : previous_(at::get_num_threads()) {
    at::set_num_threads(static_cast<int>(threads));
  }
  ~ThreadsGuard() {
    at::set_num_threads(previous_);
  }
  ThreadsGuard(const ThreadsGuard&) = delete;
  ThreadsGuard& operator=(const ThreadsGuard&) = delete;

 private:
  int previous_;
};

// One pass over the layers: times added into `costs` (when `timed`), or
// the bytes each forward keeps recorded (when not: the counting pass).
void one_pass(
    Sandbox& sandbox,
    const Packet& start,
    const torch::Tensor& target,
    const LossFunction& loss_fn,
    bool timed,
    LayerCosts& costs) {
  ProfileSkipTracker tracker;
  SkipTrackerGuard tracker_guard(&tracker);
  Packet x = start;
  for (const auto k : c10::irange(sandbox.size())) {
    ProfiledLayer layer(sandbox, k);
    x = layer_input(x);
    tracker.begin_layer(static_cast<int64_t>(k));
    Packet y;
    try {
      auto tick = Clock::now();
      if (timed) {
        // As a cell of the pipeline runs it (random.cpp: run_own).
        std::optional<CellGeneratorScope> own;
        if (costs.draws[k] && cell_generators_available()) {
          own.emplace(at::make_generator<at::CPUGeneratorImpl>(k));
        }
        y = call_layer(layer.module(), x, k);
        costs.forward[k] += seconds_since(tick);
      } else {
        CountingWindow window;
        std::optional<CellGeneratorScope> own;
        const auto gen = at::make_generator<at::CPUGeneratorImpl>(k);
        if (cell_generators_available()) {
          own.emplace(gen);
        }
        const GeneratorSnapshot own_before(gen);
        const GeneratorSnapshot before(torch::kCPU);
        y = call_layer(layer.module(), x, k);
        own.reset();
        costs.draws_alone[k] = GeneratorSnapshot(torch::kCPU) != before;
        costs.draws[k] =
            costs.draws_alone[k] || GeneratorSnapshot(gen) != own_before;
        costs.kept_bytes[k] = static_cast<double>(window.bytes());
        costs.input_bytes[k] = bytes_of(x);
        costs.param_bytes[k] = parameter_bytes(*layer.module().ptr(), true);
        costs.frozen_bytes[k] =
            parameter_bytes(*layer.module().ptr(), /*trainable=*/false);
      }
      auto roots = tracker.end_layer();
      for (const auto& t : y.tensors) {
        if (t.defined() && t.requires_grad()) {
          roots.push_back(t);
        }
      }
      std::vector<torch::Tensor> inputs;
      for (const auto& t : x.tensors) {
        if (t.defined() && t.requires_grad()) {
          inputs.push_back(t);
        }
      }
      std::vector<torch::Tensor> weights;
      for (const auto& p : layer.module().ptr()->parameters()) {
        if (p.requires_grad()) {
          weights.push_back(p);
        }
      }
      if (!roots.empty() && (!inputs.empty() || !weights.empty())) {
        std::vector<torch::Tensor> grads;
        for (const auto& r : roots) {
          grads.push_back(r.detach());
        }
        // The input part, then the weight part, as a split backward runs
        // them; the graph stays for the second.
        tick = Clock::now();
        if (!inputs.empty()) {
          torch::autograd::grad(
              roots,
              inputs,
              grads,
              /*retain_graph=*/!weights.empty(),
              /*create_graph=*/false,
              /*allow_unused=*/true);
        }
        if (timed) {
          costs.input[k] += seconds_since(tick);
        }
        tick = Clock::now();
        if (!weights.empty()) {
          torch::autograd::grad(
              roots,
              weights,
              grads,
              /*retain_graph=*/false,
              /*create_graph=*/false,
              /*allow_unused=*/true);
        }
        if (timed) {
          costs.weight[k] += seconds_since(tick);
        }
      }
    } catch (c10::Error& e) {
      TORCH_RETHROW(
          e, "while profiling layer ", k, " ('", sandbox.name(k), "')");
    } catch (const std::exception& e) {
      // Every error of the library is a c10::Error.
      TORCH_CHECK(
          false,
          e.what(),
          " (while profiling layer ",
          k,
          " ('",
          sandbox.name(k),
          "'))");
    }
    x = std::move(y);
  }
  TORCH_CHECK_TYPE(
      x.atomic && x.tensors.size() == 1,
      "autotune: the last layer must return one tensor for the loss, but it "
      "returned ",
      x.tensors.size());
  auto out = x.tensors[0].detach().requires_grad_(true);
  const auto tick = Clock::now();
  torch::Tensor loss;
  try {
    loss = loss_fn(out, target);
    TORCH_CHECK_VALUE(
        loss.defined(),
        "autotune: loss_fn must return a scalar, but it returned an "
        "undefined tensor");
    TORCH_CHECK_VALUE(
        loss.numel() == 1,
        "autotune: loss_fn must return a scalar, but it returned a tensor of "
        "shape ",
        loss.sizes());
    loss.backward();
  } catch (c10::Error& e) {
    TORCH_RETHROW(
        e,
        "while profiling the loss on micro-batches of ",
        out.size(0),
        " rows");
  } catch (const std::exception& e) {
    // Every error of the library is a c10::Error.
    TORCH_CHECK(
        false,
        "autotune: loss_fn threw: ",
        e.what(),
        " (while profiling the loss on micro-batches of ",
        out.size(0),
        " rows)");
  }
  if (timed) {
    costs.loss += seconds_since(tick);
  }
}

}  // namespace

LayerCosts profile_layer_costs(
    const torch::nn::Sequential& module,
    const torch::Tensor& input,
    const torch::Tensor& target,
    const LossFunction& loss_fn,
    int64_t rows,
    double seconds,
    int64_t threads,
    int64_t busy_lanes) {
  check_module(module);
  verify_skippables(module);
  c10::InferenceMode no_inference(/*enabled=*/false);
  torch::AutoGradMode grad_mode(/*enabled=*/true);
  CpuGeneratorAside rng(torch::kCPU);
  ThreadsGuard threads_guard(threads);

  Packet start{{input.narrow(0, 0, rows).detach().clone()}, true};
  const auto micro_target = target.narrow(0, 0, rows).detach().clone();
  Sandbox sandbox(module, torch::kCPU);
  const auto n = sandbox.size();
  LayerCosts costs;
  costs.rows = rows;
  costs.forward.assign(n, 0.0);
  costs.input.assign(n, 0.0);
  costs.weight.assign(n, 0.0);
  costs.kept_bytes.assign(n, 0.0);
  costs.input_bytes.assign(n, 0.0);
  costs.param_bytes.assign(n, 0.0);
  costs.frozen_bytes.assign(n, 0.0);
  costs.draws.assign(n, false);
  costs.draws_alone.assign(n, false);
  {
    // The first pass counts bytes (and warms up): not timed.
    CountingAllocatorScope counting;
    one_pass(sandbox, start, micro_target, loss_fn, /*timed=*/false, costs);
  }
  // The other lanes at work meanwhile, as in the pipeline, each drawing
  // from a stream of its own; joined before this one's is let go.
  BusyLanes others(module, start.tensors[0], busy_lanes, threads);
  int64_t passes = 0;
  const auto begun = Clock::now();
  do {
    one_pass(sandbox, start, micro_target, loss_fn, /*timed=*/true, costs);
    ++passes;
  } while (seconds_since(begun) < seconds);
  const auto p = static_cast<double>(passes);
  for (const auto k : c10::irange(n)) {
    costs.forward[k] /= p;
    costs.input[k] /= p;
    costs.weight[k] /= p;
  }
  costs.loss /= p;
  return costs;
}

BusyLanes::BusyLanes(
    const torch::nn::Sequential& module,
    const torch::Tensor& input,
    int64_t count,
    int64_t threads) {
  std::vector<torch::nn::Sequential> copies;
  try {
    for (int64_t k = 0; k < count; ++k) {
      copies.push_back(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(
          module->clone()));
    }
  } catch (const c10::Error&) {
    return;  // a layer that does not clone: profile without the load
  }
  // So that the copies' threads keep what they free as the lanes do (Note
  // [Lanes and glibc's malloc]).
  keep_freed_memory_once();
  for (auto& copy : copies) {
    auto x = input.detach().clone();
    threads_.emplace_back([this, copy, x, threads]() mutable {
      at::set_num_threads(static_cast<int>(threads));
      c10::InferenceMode no_inference(/*enabled=*/false);
      torch::AutoGradMode grad_mode(/*enabled=*/true);
      try {
        // Its draws (dropout) from a stream of its own, as the profiling
        // thread's: the default generator stays still.
        CpuGeneratorAside rng(torch::kCPU);
        while (!stop_.load()) {
          auto y = copy->forward(x);
          y.sum().backward();
        }
      } catch (const std::exception&) {
        // A model that does not run this way loads nothing more.
      }
    });
  }
}

BusyLanes::~BusyLanes() {
  stop_.store(true);
  for (auto& t : threads_) {
    t.join();
  }
}

}  // namespace gpipe::detail
