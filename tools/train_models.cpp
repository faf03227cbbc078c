// gpipe-train's models: the --model entries and how each is built (see
// train_args.h).

#include <gpipe/gpipe.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "train_args.h"

namespace gpipe_train {

torch::nn::Sequential make_cnn() {
  namespace nn = torch::nn;
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)),
      nn::BatchNorm2d(32),
      nn::ReLU(),
      nn::MaxPool2d(2),
      nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)),
      nn::BatchNorm2d(64),
      nn::ReLU(),
      nn::MaxPool2d(2),
      nn::Flatten(),
      nn::Linear(64 * 7 * 7, 128),
      nn::ReLU(),
      nn::Dropout(0.25),
      nn::Linear(128, 10));
}

// A U-Net classifier: the 28x28 images padded to 32x32 (the depth-5 U-Net
// halves them 5 times), a U-Net(B=1, C=8) producing 16 maps at full
// resolution, average-pooled to 8x8 and classified by a Linear layer. (A
// global average would see next to nothing: every map comes out of
// InstanceNorm with zero mean and unit variance.)
torch::nn::Sequential make_unet() {
  namespace nn = torch::nn;
  auto body = gpipe::models::unet(
      /*B=*/1, /*C=*/8, /*in_channels=*/1, /*out_channels=*/16);
  nn::Sequential net;
  net->push_back("pad", nn::ZeroPad2d(2));
  const auto names = body->named_children();
  size_t k = 0;
  for (const auto& layer : *body) {
    net->push_back(std::string(names[k++].key()), layer);
  }
  net->push_back("avgpool", nn::AvgPool2d(4));
  net->push_back("flat", nn::Flatten());
  net->push_back("fc", nn::Linear(16 * 8 * 8, 10));
  return net;
}

const std::vector<ModelSpec>& model_specs() {
  static const std::vector<ModelSpec> specs{
      {"cnn", 13, {}},
      // 39 layers: stem 0-2, bottlenecks 3-13, 14-24, 25-35, head 36-38. The
      // cut after the second bottleneck's relu2 splits the work about in two
      // and carries that block's identity across.
      {"resnet", 39, {21, 18}},
      // 69 layers: pad, encoder levels 0-4 of 6 layers (1-30), the
      // bottleneck (31-34), decoder levels 4-0 of 6 layers (35-64), segment
      // and head (65-68). The cut after decoder level 4 splits the
      // multiply-adds about in two and carries the skips of levels 0-3
      // across.
      {"unet", 69, {41, 28}}};
  return specs;
}

const ModelSpec& model_spec(const std::string& name) {
  const auto& specs = model_specs();
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const auto& s) {
    return s.name == name;
  });
  TORCH_INTERNAL_ASSERT(it != specs.end(), "no model named ", name);
  return *it;
}

torch::nn::Sequential make_model(const ModelSpec& spec) {
  torch::nn::Sequential net;
  if (spec.name == "resnet") {
    net = gpipe::models::resnet_small(10);
  } else if (spec.name == "unet") {
    net = make_unet();
  } else {
    net = make_cnn();
  }
  TORCH_INTERNAL_ASSERT(
      static_cast<int64_t>(net->size()) == spec.layers,
      "model_specs() says --model ",
      spec.name,
      " has ",
      spec.layers,
      " layers, but it has ",
      net->size());
  return net;
}

}  // namespace gpipe_train
