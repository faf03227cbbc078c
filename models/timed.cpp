#include <gpipe/models/timed.h>
#include <torch/autograd.h>

#include <thread>

namespace gpipe::models {

namespace {

// Waits `d` on the clock, yielding the core to others meanwhile.
void wait_for(std::chrono::microseconds d) {
  if (d.count() > 0) {
    std::this_thread::sleep_for(d);
  }
}

struct Timed : torch::autograd::Function<Timed> {
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      torch::Tensor x,
      torch::Tensor w,
      const TimedCosts* costs,
      TimedCounts* counts) {
    wait_for(costs->forward);
    if (counts != nullptr) {
      ++counts->forward;
    }
    ctx->saved_data["costs"] = reinterpret_cast<int64_t>(costs);
    ctx->saved_data["counts"] = reinterpret_cast<int64_t>(counts);
    ctx->save_for_backward({x, w});
    return x * w;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto* costs =
        reinterpret_cast<const TimedCosts*>(ctx->saved_data["costs"].toInt());
    auto* counts =
        reinterpret_cast<TimedCounts*>(ctx->saved_data["counts"].toInt());
    const auto saved = ctx->get_saved_variables();
    const auto& g = grads[0];
    torch::Tensor dx;
    torch::Tensor dw;
    if (ctx->needs_input_grad(0)) {
      wait_for(costs->backward_input);
      if (counts != nullptr) {
        ++counts->backward_input;
      }
      dx = g * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      wait_for(costs->backward_weight);
      if (counts != nullptr) {
        ++counts->backward_weight;
      }
      dw = (g * saved[0]).reshape({-1, saved[1].numel()}).sum(0);
    }
    return {dx, dw, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

TimedLayerImpl::TimedLayerImpl(
    int64_t features, TimedCosts costs, std::shared_ptr<TimedCounts> counts)
    : features_(features), costs_(costs), counts_(std::move(counts)) {
  reset();
}

void TimedLayerImpl::reset() {
  weight = register_parameter("weight", torch::ones({features_}));
}

torch::Tensor TimedLayerImpl::forward(torch::Tensor x) {
  return Timed::apply(x, weight, &costs_, counts_.get());
}

}  // namespace gpipe::models
