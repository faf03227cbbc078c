#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/models/resnet.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include <string>
#include <utility>

#include "layers.h"

namespace gpipe::models {
namespace {

namespace nn = torch::nn;

// The expansion of a bottleneck: it outputs 4 x its planes.
constexpr int64_t kExpansion = 4;

nn::Conv2d conv(
    int64_t in_channels,
    int64_t out_channels,
    int64_t kernel_size,
    int64_t stride = 1,
    int64_t padding = 0) {
  return nn::Conv2d(nn::Conv2dOptions(in_channels, out_channels, kernel_size)
                        .stride(stride)
                        .padding(padding)
                        .bias(false));
}

// Pops the block's identity, downsamples it (1x1 convolution and BatchNorm)
// when the block changes its shape, and adds it to the block's output.
class ResidualImpl : public nn::Cloneable<ResidualImpl>,
                     public Skippable,
                     public ConvertibleToDeferredBatchNorm {
 public:
  ResidualImpl(int64_t in_channels, int64_t out_channels, int64_t stride)
      : Skippable(/*stash=*/{}, /*pop=*/{"identity"}),
        in_channels_(in_channels),
        out_channels_(out_channels),
        stride_(stride) {
    reset();
  }

  void reset() override {
    if (stride_ != 1 || in_channels_ != out_channels_) {
      downsample_ = register_module(
          "downsample",
          nn::Sequential(
              conv(in_channels_, out_channels_, 1, stride_),
              nn::BatchNorm2d(out_channels_)));
    }
  }

  torch::Tensor forward(torch::Tensor input) {
    auto identity = pop("identity");
    if (downsample_) {
      identity = downsample_->forward(identity);
    }
    return input + identity;
  }

  // A copy (the same skip names, parameters and buffers) whose
  // downsampling BatchNorm is a DeferredBatchNorm.
  nn::AnyModule to_deferred_batch_norm(int64_t chunks) const override {
    auto copy = std::make_shared<ResidualImpl>(*this);
    if (downsample_) {
      copy->downsample_ = copy->replace_module(
          "downsample", convert_deferred_batch_norm(downsample_, chunks));
    }
    return nn::AnyModule(copy);
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "gpipe::models::Residual(" << in_channels_ << ", "
           << out_channels_ << ", stride=" << stride_ << ")";
  }

 private:
  int64_t in_channels_;
  int64_t out_channels_;
  int64_t stride_;
  nn::Sequential downsample_{nullptr};
};
TORCH_MODULE(Residual);

// Appends one bottleneck as 11 layers named `<prefix>_<layer>`.
void add_bottleneck(
    nn::Sequential& net,
    const std::string& prefix,
    int64_t in_channels,
    int64_t planes,
    int64_t stride) {
  const int64_t out_channels = planes * kExpansion;
  // One namespace per block: every block stashes and pops "identity".
  const Namespace ns;
  detail::Stash identity("identity");
  identity->isolate(ns);
  Residual residual(in_channels, out_channels, stride);
  residual->isolate(ns);

  net->push_back(prefix + "_identity", identity);
  net->push_back(prefix + "_conv1", conv(in_channels, planes, 1));
  net->push_back(prefix + "_bn1", nn::BatchNorm2d(planes));
  net->push_back(prefix + "_relu1", nn::ReLU());
  net->push_back(prefix + "_conv2", conv(planes, planes, 3, stride, 1));
  net->push_back(prefix + "_bn2", nn::BatchNorm2d(planes));
  net->push_back(prefix + "_relu2", nn::ReLU());
  net->push_back(prefix + "_conv3", conv(planes, out_channels, 1));
  net->push_back(prefix + "_bn3", nn::BatchNorm2d(out_channels));
  net->push_back(prefix + "_residual", residual);
  net->push_back(prefix + "_relu3", nn::ReLU());
}

}  // namespace

torch::nn::Sequential resnet(
    std::vector<int64_t> blocks_per_stage,
    int64_t num_classes,
    const ResNetOptions& options) {
  TORCH_CHECK_VALUE(
      !blocks_per_stage.empty(),
      "resnet: expected at least one stage in blocks_per_stage, but got none");
  for (const auto s : c10::irange(blocks_per_stage.size())) {
    TORCH_CHECK_VALUE(
        blocks_per_stage[s] >= 1,
        "resnet: expected at least 1 block per stage, but stage ",
        s,
        " has ",
        blocks_per_stage[s]);
  }
  TORCH_CHECK_VALUE(
      num_classes >= 1,
      "resnet: expected num_classes >= 1, but got ",
      num_classes);
  TORCH_CHECK_VALUE(
      options.in_channels() >= 1,
      "resnet: expected in_channels >= 1, but got ",
      options.in_channels());
  TORCH_CHECK_VALUE(
      options.width() >= 1,
      "resnet: expected width >= 1, but got ",
      options.width());

  const int64_t width = options.width();
  nn::Sequential net;
  if (options.small_stem()) {
    net->push_back("conv1", conv(options.in_channels(), width, 3, 1, 1));
    net->push_back("bn1", nn::BatchNorm2d(width));
    net->push_back("relu", nn::ReLU());
  } else {
    net->push_back("conv1", conv(options.in_channels(), width, 7, 2, 3));
    net->push_back("bn1", nn::BatchNorm2d(width));
    net->push_back("relu", nn::ReLU());
    net->push_back(
        "maxpool", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  }

  int64_t channels = width;
  int64_t planes = width;
  for (const auto s : c10::irange(blocks_per_stage.size())) {
    const std::string stage = "layer" + std::to_string(s + 1);
    for (const auto b : c10::irange(blocks_per_stage[s])) {
      // Stages after the first halve the resolution in their first block.
      const int64_t stride = (s > 0 && b == 0) ? 2 : 1;
      add_bottleneck(
          net, stage + "_" + std::to_string(b), channels, planes, stride);
      channels = planes * kExpansion;
    }
    planes *= 2;
  }

  net->push_back("avgpool", nn::AdaptiveAvgPool2d(1));
  net->push_back("flat", nn::Flatten());
  net->push_back("fc", nn::Linear(channels, num_classes));

  // torchvision's initialisation; BatchNorm already starts at weight 1,
  // bias 0 and Linear keeps its default.
  torch::NoGradGuard no_grad;
  for (const auto& module : net->modules(/*include_self=*/false)) {
    if (auto* c = module->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(
          c->weight, /*a=*/0, torch::kFanOut, torch::kReLU);
    }
  }
  return net;
}

torch::nn::Sequential resnet101(int64_t num_classes) {
  return resnet({3, 4, 23, 3}, num_classes);
}

torch::nn::Sequential resnet_small(int64_t num_classes) {
  return resnet(
      {1, 1, 1},
      num_classes,
      ResNetOptions().in_channels(1).width(8).small_stem(true));
}

}  // namespace gpipe::models
