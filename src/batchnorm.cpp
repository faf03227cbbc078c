#include <gpipe/batchnorm.h>
#include <gpipe/checkpoint.h>
#include <torch/torch.h>

#include <string>

namespace gpipe {

DeferredBatchNormImpl::DeferredBatchNormImpl(DeferredBatchNormOptions options_)
    : options(std::move(options_)) {
  reset();
}

DeferredBatchNormImpl::DeferredBatchNormImpl(
    DeferredBatchNormOptions options_, std::vector<torch::Tensor> adopt)
    : options(std::move(options_)), adopt_(std::move(adopt)) {
  reset();
}

void DeferredBatchNormImpl::train(bool on) {
  torch::nn::Module::train(on);
  if (auto replaced = replaced_.lock()) {
    replaced->train(on);
  }
}

bool DeferredBatchNormImpl::in_training() const {
  if (auto replaced = replaced_.lock()) {
    return replaced->is_training();
  }
  return is_training();
}

namespace {

template <typename BatchNorm>
bool options_from(
    const torch::nn::Module& module,
    double& eps,
    c10::optional<double>& momentum) {
  const auto* bn = dynamic_cast<const BatchNorm*>(&module);
  if (bn != nullptr) {
    eps = bn->options.eps();
    momentum = bn->options.momentum();
  }
  return bn != nullptr;
}

}  // namespace

void DeferredBatchNormImpl::eps_and_momentum(
    double& eps, c10::optional<double>& momentum) const {
  // The replaced BatchNorm's, which the user may change between steps (a
  // momentum schedule), as the plain model would use them.
  if (auto replaced = replaced_.lock()) {
    if (options_from<torch::nn::BatchNorm1dImpl>(*replaced, eps, momentum) ||
        options_from<torch::nn::BatchNorm2dImpl>(*replaced, eps, momentum) ||
        options_from<torch::nn::BatchNorm3dImpl>(*replaced, eps, momentum)) {
      return;
    }
  }
  eps = options.eps();
  momentum = options.momentum();
}

void DeferredBatchNormImpl::reset() {
  TORCH_CHECK_VALUE(
      options.num_features() > 0,
      "DeferredBatchNorm expects num_features > 0, but got ",
      options.num_features());
  TORCH_CHECK_VALUE(
      options.chunks() > 0,
      "DeferredBatchNorm expects chunks > 0, but got ",
      options.chunks());
  const auto c = options.num_features();
  engine_commits_ = false;  // a copy is not inside the engine
  replaced_.reset();        // nor does it follow the original's BatchNorm
  std::vector<torch::Tensor> adopt;
  std::swap(adopt, adopt_);
  auto take = [&adopt](size_t k, torch::Tensor fresh) {
    return adopt.empty() || !adopt.at(k).defined() ? fresh : adopt.at(k);
  };
  if (options.affine()) {
    // An adopted parameter keeps its requires_grad: registering it would
    // otherwise set the flag on the tensor it shares with the user's
    // BatchNorm, and a frozen layer would train.
    auto param = [&](size_t k, const char* name, torch::Tensor fresh) {
      auto value = take(k, std::move(fresh));
      const bool requires_grad =
          adopt.empty() || !adopt.at(k).defined() || value.requires_grad();
      return register_parameter(name, value, requires_grad);
    };
    weight = param(0, "weight", torch::ones({c}));
    bias = param(1, "bias", torch::zeros({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), false);
    bias = register_parameter("bias", torch::Tensor(), false);
  }
  running_mean = register_buffer("running_mean", take(2, torch::zeros({c})));
  running_var = register_buffer("running_var", take(3, torch::ones({c})));
  num_batches_tracked = register_buffer(
      "num_batches_tracked", take(4, torch::zeros({}, torch::kLong)));
  discard();
}

void DeferredBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "gpipe::DeferredBatchNorm(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << (options.affine() ? "true" : "false")
         << ", chunks=" << options.chunks() << ")";
}

torch::Tensor DeferredBatchNormImpl::forward(torch::Tensor input) {
  TORCH_CHECK_VALUE(
      input.dim() >= 2,
      "DeferredBatchNorm expects an input of at least 2 dimensions (N, C, "
      "...), but got ",
      input.dim(),
      "D input");
  TORCH_CHECK_VALUE(
      input.size(1) == options.num_features(),
      "DeferredBatchNorm expects ",
      options.num_features(),
      " channels in dimension 1, but got ",
      input.size(1));
  double eps = 0;
  c10::optional<double> momentum;
  eps_and_momentum(eps, momentum);
  if (!in_training()) {
    return torch::batch_norm(
        input,
        weight,
        bias,
        running_mean,
        running_var,
        /*training=*/false,
        /*momentum=*/0.0,
        eps,
        torch::globalContext().userEnabledCuDNN());
  }
  // As BatchNorm refuses it: a micro-batch of one value per channel would
  // be normalised to zeros, whatever the input.
  TORCH_CHECK_VALUE(
      input.size(1) == 0 || input.numel() / input.size(1) > 1,
      "DeferredBatchNorm expects more than 1 value per channel when "
      "training, as BatchNorm does, but got input size ",
      input.sizes(),
      " (one row per micro-batch normalises to zeros: give fewer chunks or a "
      "larger batch)");
  auto output = torch::batch_norm(
      input,
      weight,
      bias,
      /*running_mean=*/{},
      /*running_var=*/{},
      /*training=*/true,
      /*momentum=*/0.0,
      eps,
      torch::globalContext().userEnabledCuDNN());
  if (is_recomputing()) {
    return output;  // counted in the first forward already
  }

  torch::NoGradGuard no_grad;
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  const auto x = input.detach();
  const int64_t n = x.numel() / x.size(1);
  auto [var, mean] = torch::var_mean(x, dims, /*unbiased=*/false);
  auto m2 = var * static_cast<double>(n);
  if (count_ == 0) {
    mean_ = mean;
    m2_ = m2;
  } else {
    // Chan et al.'s merge of two partial means and sums of squares.
    const double total = static_cast<double>(count_ + n);
    auto delta = mean - mean_;
    mean_ = mean_ + delta * (static_cast<double>(n) / total);
    m2_ = m2_ + m2 + delta * delta * (static_cast<double>(count_) * n / total);
  }
  count_ += n;
  if (++tracked_ >= options.chunks() && !engine_commits_) {
    commit();
  }
  return output;
}

void DeferredBatchNormImpl::commit() {
  if (tracked_ == 0) {
    return;
  }
  torch::NoGradGuard no_grad;
  num_batches_tracked.variable_data().add_(1);
  double eps = 0;
  c10::optional<double> momentum;
  eps_and_momentum(eps, momentum);
  const double factor =
      momentum ? *momentum
               : 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  // The unbiased variance, as BatchNorm's running_var.
  auto var = m2_ / static_cast<double>(std::max<int64_t>(count_ - 1, 1));
  // variable_data(): as BatchNorm's own update, this must not bump the
  // version counter of buffers that a pending backward may have saved.
  running_mean.variable_data()
      .mul_(1.0 - factor)
      .add_(mean_.to(running_mean.dtype()), factor);
  running_var.variable_data()
      .mul_(1.0 - factor)
      .add_(var.to(running_var.dtype()), factor);
  discard();
}

void DeferredBatchNormImpl::discard() {
  mean_ = torch::Tensor();
  m2_ = torch::Tensor();
  count_ = 0;
  tracked_ = 0;
}

namespace {

// The options and state of a BatchNorm{1,2,3}d child, if it is one that
// tracks running statistics.
template <typename Impl>
c10::optional<DeferredBatchNormOptions> options_of(
    const std::shared_ptr<torch::nn::Module>& child, int64_t chunks) {
  auto bn = std::dynamic_pointer_cast<Impl>(child);
  if (!bn || !bn->options.track_running_stats()) {
    return c10::nullopt;
  }
  DeferredBatchNormOptions options(bn->options.num_features());
  options.eps(bn->options.eps())
      .momentum(bn->options.momentum())
      .affine(bn->options.affine())
      .chunks(chunks);
  return options;
}

bool is_batch_norm(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module);
}

}  // namespace

torch::nn::Sequential convert_deferred_batch_norm(
    const torch::nn::Sequential& module, int64_t chunks) {
  torch::nn::Sequential converted;
  auto named = module->named_children();
  for (const auto k : c10::irange(module->size())) {
    const auto& name = named[k].key();
    const auto& any = *(module->begin() + k);
    auto child = any.ptr();
    c10::optional<DeferredBatchNormOptions> options;
    if (auto existing =
            std::dynamic_pointer_cast<DeferredBatchNormImpl>(child)) {
      if (existing->options.chunks() == chunks) {
        converted->push_back(name, any);
        continue;
      }
      options = existing->options;
      options->chunks(chunks);
    }
    if (!options) {
      options = options_of<torch::nn::BatchNorm1dImpl>(child, chunks);
    }
    if (!options) {
      options = options_of<torch::nn::BatchNorm2dImpl>(child, chunks);
    }
    if (!options) {
      options = options_of<torch::nn::BatchNorm3dImpl>(child, chunks);
    }
    if (options) {
      // Share the replaced layer's parameters and buffers.
      auto params = child->named_parameters(/*recurse=*/false);
      auto buffers = child->named_buffers(/*recurse=*/false);
      auto param = [&params](const char* key) {
        return params.contains(key) ? params[key] : torch::Tensor();
      };
      std::shared_ptr<DeferredBatchNormImpl> deferred(new DeferredBatchNormImpl(
          *options,
          {param("weight"),
           param("bias"),
           buffers["running_mean"],
           buffers["running_var"],
           buffers["num_batches_tracked"]}));
      deferred->train(child->is_training());
      deferred->replaced_ = child;
      converted->push_back(name, torch::nn::AnyModule(deferred));
      continue;
    }
    auto kept = any;
    const auto* convertible =
        dynamic_cast<const ConvertibleToDeferredBatchNorm*>(child.get());
    if (convertible != nullptr) {
      kept = convertible->to_deferred_batch_norm(chunks);
      TORCH_CHECK_VALUE(
          !kept.is_empty(),
          "deferred_batch_norm: the ",
          child->name(),
          " at '",
          name,
          "' gave an empty module from to_deferred_batch_norm");
    }
    const auto layer = kept.ptr();
    for (const auto& inner : layer->named_modules("", /*include_self=*/false)) {
      TORCH_CHECK_VALUE(
          !is_batch_norm(*inner.value()),
          "deferred_batch_norm cannot replace the BatchNorm at '",
          name,
          ".",
          inner.key(),
          "' inside a ",
          layer->name(),
          convertible != nullptr
              ? ": its to_deferred_batch_norm left it in place; replace every "
                "BatchNorm inside it there"
              : ": only BatchNorm layers that are children of the Sequential "
                "can be replaced; flatten that layer into the Sequential, "
                "make it a gpipe::ConvertibleToDeferredBatchNorm, or use "
                "gpipe::DeferredBatchNorm in it directly");
    }
    converted->push_back(name, kept);
  }
  return converted;
}

}  // namespace gpipe
