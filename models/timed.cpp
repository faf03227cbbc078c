#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
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

// The counts a graph updates, kept alive by the graph itself (a layer may
// go before the backward of its output runs).
struct CountsHolder : torch::CustomClassHolder {
  explicit CountsHolder(std::shared_ptr<TimedCounts> c)
      : counts(std::move(c)) {}
  std::shared_ptr<TimedCounts> counts;
};

struct Timed : torch::autograd::Function<Timed> {
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      torch::Tensor x,
      torch::Tensor w,
      const TimedCosts& costs,
      const std::shared_ptr<TimedCounts>& counts) {
    wait_for(costs.forward);
    if (counts != nullptr) {
      ++counts->forward;
    }
    // Values, not pointers into the layer.
    ctx->saved_data["backward_input_us"] =
        static_cast<int64_t>(costs.backward_input.count());
    ctx->saved_data["backward_weight_us"] =
        static_cast<int64_t>(costs.backward_weight.count());
    ctx->saved_data["counts"] =
        c10::IValue::make_capsule(c10::make_intrusive<CountsHolder>(counts));
    ctx->save_for_backward({x, w});
    return x * w;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const std::chrono::microseconds backward_input{
        ctx->saved_data["backward_input_us"].toInt()};
    const std::chrono::microseconds backward_weight{
        ctx->saved_data["backward_weight_us"].toInt()};
    const auto holder = c10::static_intrusive_pointer_cast<CountsHolder>(
        ctx->saved_data["counts"].toCapsule());
    auto* counts = holder->counts.get();
    const auto saved = ctx->get_saved_variables();
    const auto& g = grads[0];
    torch::Tensor dx;
    torch::Tensor dw;
    if (ctx->needs_input_grad(0)) {
      wait_for(backward_input);
      if (counts != nullptr) {
        ++counts->backward_input;
      }
      dx = g * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      wait_for(backward_weight);
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
  TORCH_CHECK_VALUE(
      features >= 1, "TimedLayer: expected features >= 1, but got ", features);
  TORCH_CHECK_VALUE(
      costs.forward.count() >= 0 && costs.backward_input.count() >= 0 &&
          costs.backward_weight.count() >= 0,
      "TimedLayer: expected costs of 0 us or more, but got forward ",
      costs.forward.count(),
      " us, backward_input ",
      costs.backward_input.count(),
      " us, backward_weight ",
      costs.backward_weight.count(),
      " us");
  reset();
}

void TimedLayerImpl::reset() {
  weight = register_parameter("weight", torch::ones({features_}));
}

torch::Tensor TimedLayerImpl::forward(torch::Tensor x) {
  return Timed::apply(x, weight, costs_, counts_);
}

}  // namespace gpipe::models
