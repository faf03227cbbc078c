#include <c10/util/irange.h>
#include <gpipe/models/amoebanet.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::models {
namespace {

namespace nn = torch::nn;

enum class Op {
  None,  // identity, or a FactorizedReduce where it reduces
  AvgPool3x3,
  MaxPool3x3,  // an average pooling, as in torchgpipe
  MaxPool2x2,
  Conv1x1,
  Conv3x3,      // bottlenecked: 1x1 to C/4, 3x3, 1x1 back to C
  Conv1x7_7x1,  // bottlenecked: 1x1 to C/4, 1x7, 7x1, 1x1 back to C
};

// A cell's operations in pairs: the states they read and what they do. Each
// pair's sum becomes the next state; states 0 and 1 are the cell's inputs.
struct Step {
  int64_t state;
  Op op;
};

constexpr std::array<Step, 10> kNormal = {{
    {1, Op::Conv1x1},
    {1, Op::MaxPool3x3},
    {1, Op::None},
    {0, Op::Conv1x7_7x1},
    {0, Op::Conv1x1},
    {0, Op::Conv1x7_7x1},
    {2, Op::MaxPool3x3},
    {2, Op::None},
    {1, Op::AvgPool3x3},
    {5, Op::Conv1x1},
}};
// The states a normal cell concatenates: TensorFlow's reference AmoebaNet-D
// (the paper says {4, 5, 6}); torchgpipe chose it because it reproduces the
// GPipe paper's parameter counts.
const std::vector<int64_t> kNormalConcat = {0, 3, 4, 6};

constexpr std::array<Step, 10> kReduction = {{
    {0, Op::MaxPool2x2},
    {0, Op::MaxPool3x3},
    {2, Op::None},
    {1, Op::Conv3x3},
    {2, Op::Conv1x7_7x1},
    {2, Op::MaxPool3x3},
    {3, Op::None},
    {1, Op::MaxPool2x2},
    {2, Op::AvgPool3x3},
    {3, Op::Conv1x1},
}};
const std::vector<int64_t> kReductionConcat = {4, 5, 6};

nn::Conv2d conv(
    int64_t in_channels,
    int64_t out_channels,
    torch::ExpandingArray<2> kernel_size,
    torch::ExpandingArray<2> stride = 1,
    torch::ExpandingArray<2> padding = 0) {
  return nn::Conv2d(nn::Conv2dOptions(in_channels, out_channels, kernel_size)
                        .stride(stride)
                        .padding(padding)
                        .bias(false));
}

nn::Sequential relu_conv_bn(int64_t in_channels, int64_t out_channels) {
  return nn::Sequential(
      nn::ReLU(),
      conv(in_channels, out_channels, 1),
      nn::BatchNorm2d(out_channels));
}

// Halves the resolution with two 1x1 stride-2 convolutions of half the
// channels each, the second one shifted by one pixel, concatenated.
class FactorizedReduceImpl : public nn::Cloneable<FactorizedReduceImpl> {
 public:
  FactorizedReduceImpl(int64_t in_channels, int64_t out_channels)
      : in_channels_(in_channels), out_channels_(out_channels) {
    reset();
  }

  void reset() override {
    conv1_ = register_module(
        "conv1", conv(in_channels_, out_channels_ / 2, 1, /*stride=*/2));
    conv2_ = register_module(
        "conv2", conv(in_channels_, out_channels_ / 2, 1, /*stride=*/2));
    bn_ = register_module("bn", nn::BatchNorm2d(out_channels_));
  }

  torch::Tensor forward(torch::Tensor input) {
    auto x = torch::relu(input);
    auto shifted = nn::functional::pad(
        x.slice(2, 1).slice(3, 1),
        nn::functional::PadFuncOptions({0, 1, 0, 1}));
    return bn_->forward(
        torch::cat({conv1_->forward(x), conv2_->forward(shifted)}, 1));
  }

 private:
  int64_t in_channels_;
  int64_t out_channels_;
  nn::Conv2d conv1_{nullptr};
  nn::Conv2d conv2_{nullptr};
  nn::BatchNorm2d bn_{nullptr};
};
TORCH_MODULE(FactorizedReduce);

// A ReLU-convolution-BatchNorm chain from c to c through c/4 channels with
// the given middle kernels; the stride goes into the middle ones.
nn::Sequential bottlenecked(
    int64_t c,
    const std::vector<
        std::pair<std::array<int64_t, 2>, std::array<int64_t, 2>>>& middle) {
  const int64_t q = c / 4;
  nn::Sequential seq(nn::ReLU(), conv(c, q, 1), nn::BatchNorm2d(q));
  for (const auto& [kernel, stride] : middle) {
    seq->push_back(nn::ReLU());
    seq->push_back(conv(
        q,
        q,
        {kernel[0], kernel[1]},
        {stride[0], stride[1]},
        {kernel[0] / 2, kernel[1] / 2}));
    seq->push_back(nn::BatchNorm2d(q));
  }
  seq->push_back(nn::ReLU());
  seq->push_back(conv(q, c, 1));
  seq->push_back(nn::BatchNorm2d(c));
  return seq;
}

nn::Sequential operation(Op op, int64_t c, int64_t stride) {
  switch (op) {
    case Op::None:
      if (stride == 1) {
        return nn::Sequential(nn::Identity());
      }
      return nn::Sequential(FactorizedReduce(c, c));
    case Op::AvgPool3x3:
    case Op::MaxPool3x3:
      return nn::Sequential(nn::AvgPool2d(
          nn::AvgPool2dOptions(3).stride(stride).padding(1).count_include_pad(
              false)));
    case Op::MaxPool2x2:
      return nn::Sequential(
          nn::MaxPool2d(nn::MaxPool2dOptions(2).stride(stride)));
    case Op::Conv1x1:
      return nn::Sequential(
          nn::ReLU(), conv(c, c, 1, stride), nn::BatchNorm2d(c));
    case Op::Conv3x3:
      return bottlenecked(c, {{{3, 3}, {stride, stride}}});
    case Op::Conv1x7_7x1:
      return bottlenecked(c, {{{1, 7}, {1, stride}}, {{7, 1}, {stride, 1}}});
  }
  TORCH_INTERNAL_ASSERT(false, "unknown AmoebaNet operation");
}

// ReLU, 3x3 stride-2 convolution from RGB, BatchNorm; returns {x} so that
// the first cell reads x as both of its inputs.
class StemImpl : public nn::Cloneable<StemImpl> {
 public:
  explicit StemImpl(int64_t channels) : channels_(channels) {
    reset();
  }

  void reset() override {
    conv_ = register_module("conv", conv(3, channels_, 3, 2, 1));
    bn_ = register_module("bn", nn::BatchNorm2d(channels_));
  }

  std::vector<torch::Tensor> forward(torch::Tensor input) {
    return {bn_->forward(conv_->forward(torch::relu(input)))};
  }

 private:
  int64_t channels_;
  nn::Conv2d conv_{nullptr};
  nn::BatchNorm2d bn_{nullptr};
};
TORCH_MODULE(Stem);

// One AmoebaNet cell: takes {s1, s0} (the previous cell's output and its
// first input; {x} means s1 = s0 = x) and returns {its output, s1}.
class CellImpl : public nn::Cloneable<CellImpl> {
 public:
  CellImpl(
      int64_t channels_prev_prev,
      int64_t channels_prev,
      int64_t channels,
      bool reduction,
      bool reduction_prev)
      : channels_prev_prev_(channels_prev_prev),
        channels_prev_(channels_prev),
        channels_(channels),
        reduction_(reduction),
        reduction_prev_(reduction_prev) {
    reset();
  }

  void reset() override {
    reduce1_ =
        register_module("reduce1", relu_conv_bn(channels_prev_, channels_));
    if (reduction_prev_) {
      reduce2_ = register_module(
          "reduce2",
          nn::Sequential(FactorizedReduce(channels_prev_prev_, channels_)));
    } else if (channels_prev_prev_ != channels_) {
      reduce2_ = register_module(
          "reduce2", relu_conv_bn(channels_prev_prev_, channels_));
    } else {
      reduce2_ = register_module("reduce2", nn::Sequential(nn::Identity()));
    }
    operations_ = register_module("operations", nn::ModuleList());
    for (const auto& step : steps()) {
      // A reduction cell's operations on its inputs halve the resolution.
      const int64_t stride = reduction_ && step.state < 2 ? 2 : 1;
      operations_->push_back(operation(step.op, channels_, stride));
    }
  }

  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> inputs) {
    TORCH_CHECK_VALUE(
        inputs.size() == 1 || inputs.size() == 2,
        "AmoebaNet cell: expected 1 or 2 input tensors, but got ",
        inputs.size());
    const auto skip = inputs[0];
    std::vector<torch::Tensor> states = {
        reduce1_->forward(inputs[0]), reduce2_->forward(inputs.back())};
    const auto& plan = steps();
    for (size_t k = 0; k < plan.size(); k += 2) {
      auto h1 = operations_->ptr<nn::SequentialImpl>(k)->forward(
          states.at(plan[k].state));
      auto h2 = operations_->ptr<nn::SequentialImpl>(k + 1)->forward(
          states.at(plan[k + 1].state));
      states.push_back(h1 + h2);
    }
    std::vector<torch::Tensor> concat;
    for (const auto i : reduction_ ? kReductionConcat : kNormalConcat) {
      concat.push_back(states[i]);
    }
    return {torch::cat(concat, /*dim=*/1), skip};
  }

  /// The number of channels this cell outputs.
  int64_t out_channels() const {
    return channels_ *
           static_cast<int64_t>(
               (reduction_ ? kReductionConcat : kNormalConcat).size());
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "gpipe::models::AmoebaNetCell("
           << (reduction_ ? "reduction" : "normal")
           << ", channels=" << channels_ << ")";
  }

 private:
  const std::array<Step, 10>& steps() const {
    return reduction_ ? kReduction : kNormal;
  }

  int64_t channels_prev_prev_;
  int64_t channels_prev_;
  int64_t channels_;
  bool reduction_;
  bool reduction_prev_;
  nn::Sequential reduce1_{nullptr};
  nn::Sequential reduce2_{nullptr};
  nn::ModuleList operations_{nullptr};
};
TORCH_MODULE(Cell);

// 7x7 average pooling, Flatten and Linear on the last cell's output.
class ClassifyImpl : public nn::Cloneable<ClassifyImpl> {
 public:
  ClassifyImpl(int64_t channels, int64_t num_classes)
      : channels_(channels), num_classes_(num_classes) {
    reset();
  }

  void reset() override {
    pool_ = register_module("pool", nn::AvgPool2d(7));
    fc_ = register_module("fc", nn::Linear(channels_, num_classes_));
  }

  torch::Tensor forward(std::vector<torch::Tensor> states) {
    TORCH_CHECK_VALUE(
        !states.empty(),
        "AmoebaNet classifier: expected the last cell's outputs, but got none");
    return fc_->forward(pool_->forward(states[0]).flatten(1));
  }

 private:
  int64_t channels_;
  int64_t num_classes_;
  nn::AvgPool2d pool_{nullptr};
  nn::Linear fc_{nullptr};
};
TORCH_MODULE(Classify);

}  // namespace

torch::nn::Sequential amoebanetd(int64_t L, int64_t D, int64_t num_classes) {
  TORCH_CHECK_VALUE(
      L >= 0 && L % 3 == 0,
      "amoebanetd: expected L (normal cells) to be a non-negative multiple of "
      "3, but got ",
      L);
  // Below 8 filters the bottlenecked convolutions would have no channel.
  TORCH_CHECK_VALUE(D >= 8, "amoebanetd: expected D >= 8, but got ", D);
  TORCH_CHECK_VALUE(
      num_classes >= 1,
      "amoebanetd: expected num_classes >= 1, but got ",
      num_classes);

  // The channel bookkeeping of torchgpipe's make_cells.
  int64_t channels = D / 4;
  int64_t channels_prev_prev = channels;
  int64_t channels_prev = channels;
  bool reduction_prev = false;
  auto make_cell = [&](bool reduction) {
    Cell cell(
        channels_prev_prev, channels_prev, channels, reduction, reduction_prev);
    channels_prev_prev = channels_prev;
    channels_prev = cell->out_channels();
    reduction_prev = reduction;
    return cell;
  };

  nn::Sequential net;
  net->push_back("stem1", Stem(channels));
  auto add_reduction = [&](std::string name) {
    channels *= 2;
    net->push_back(std::move(name), make_cell(/*reduction=*/true));
  };
  auto add_normals = [&](const std::string& prefix) {
    for (const auto i : c10::irange(L / 3)) {
      net->push_back(
          prefix + std::to_string(i + 1), make_cell(/*reduction=*/false));
    }
  };
  add_reduction("stem2");
  add_reduction("stem3");
  add_normals("cell1_normal");
  add_reduction("cell2_reduction");
  add_normals("cell3_normal");
  add_reduction("cell4_reduction");
  add_normals("cell5_normal");
  net->push_back("classify", Classify(channels_prev, num_classes));
  return net;
}

}  // namespace gpipe::models
