#include <c10/util/irange.h>
#include <gpipe/models/unet.h>
#include <torch/nn/functional/instancenorm.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/upsampling.h>

#include <limits>
#include <string>
#include <vector>

#include "layers.h"

namespace gpipe::models {
namespace {

namespace nn = torch::nn;

// Pops the encoder's "skip" and concatenates it after its input on the
// channels, first padding the input on the right and bottom up to the skip's
// size (an odd size halved by max-pooling comes back one pixel short).
class PopCatImpl : public nn::Cloneable<PopCatImpl>, public Skippable {
 public:
  PopCatImpl() : Skippable(/*stash=*/{}, /*pop=*/{"skip"}) {}

  void reset() override {}

  torch::Tensor forward(torch::Tensor input) {
    auto skip = pop("skip");
    TORCH_CHECK_VALUE(
        input.dim() == 4 && skip.dim() == 4,
        "U-Net: expected 4-d tensors (N, C, H, W) to concatenate, but got ",
        input.sizes(),
        " and a skip of ",
        skip.sizes());
    const int64_t pad_h = skip.size(2) - input.size(2);
    const int64_t pad_w = skip.size(3) - input.size(3);
    if (pad_h != 0 || pad_w != 0) {
      input = nn::functional::pad(
          input, nn::functional::PadFuncOptions({0, pad_w, 0, pad_h}));
    }
    return torch::cat({input, skip}, /*dim=*/1);
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "gpipe::models::PopCat(skip)";
  }
};
TORCH_MODULE(PopCat);

// Channels of one cell: its first convolution takes `in`, the B - 1 others
// `mid`, and the last one outputs `out`.
struct CellChannels {
  int64_t in = 0;
  int64_t mid = 0;
  int64_t out = 0;
};

// The encoder cells (depth), the bottleneck cell, then the decoder cells in
// order of use (level depth-1 first), as torchgpipe lays them out.
std::vector<CellChannels> cells(
    int64_t C, int64_t in_channels, const UNetOptions& options) {
  const int64_t depth = options.depth();
  std::vector<CellChannels> result;
  for (const auto i : c10::irange(depth)) {
    const int64_t in = i == 0 ? in_channels : C << (i - 1);
    result.push_back({in, C << i, C << i});
  }
  result.push_back({C << (depth - 1), C << depth, C << (depth - 1)});
  for (int64_t i = depth - 1; i >= 0; --i) {
    // Level 0 ends with C / 2 channels (torchgpipe's int(C * 2 ** -1)).
    const int64_t out = i == 0 ? C / 2 : C << (i - 1);
    result.push_back({C << (i + 1), out, out});
  }
  return result;
}

void check_arguments(
    int64_t B,
    int64_t C,
    int64_t in_channels,
    int64_t out_channels,
    const UNetOptions& options) {
  TORCH_CHECK_VALUE(B >= 1, "unet: expected B >= 1, but got ", B);
  TORCH_CHECK_VALUE(C >= 2, "unet: expected C >= 2, but got ", C);
  TORCH_CHECK_VALUE(
      in_channels >= 1,
      "unet: expected in_channels >= 1, but got ",
      in_channels);
  TORCH_CHECK_VALUE(
      out_channels >= 1,
      "unet: expected out_channels >= 1, but got ",
      out_channels);
  TORCH_CHECK_VALUE(
      options.depth() >= 1 && options.depth() <= 30,
      "unet: expected depth between 1 and 30, but got ",
      options.depth());
  TORCH_CHECK_VALUE(
      options.dropout() >= 0 && options.dropout() <= 1,
      "unet: expected dropout in [0, 1], but got ",
      options.dropout());
  // The widest cell has C x 2^depth channels.
  TORCH_CHECK_VALUE(
      C <= (std::numeric_limits<int64_t>::max() >> options.depth()),
      "unet: C x 2^depth channels must fit in int64, but C is ",
      C,
      " and depth ",
      options.depth());
}

// Appends a cell's B units of 4 layers, named `<prefix>_<layer><unit>`.
void add_cell(
    nn::Sequential& net,
    const std::string& prefix,
    const CellChannels& cell,
    int64_t B,
    double dropout) {
  for (const auto k : c10::irange(B)) {
    const int64_t in = k == 0 ? cell.in : cell.mid;
    const int64_t out = k + 1 == B ? cell.out : cell.mid;
    const std::string unit = std::to_string(k);
    net->push_back(
        prefix + "_conv" + unit,
        nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
    net->push_back(prefix + "_dropout" + unit, nn::Dropout2d(dropout));
    net->push_back(prefix + "_norm" + unit, nn::InstanceNorm2d(out));
    net->push_back(prefix + "_relu" + unit, nn::LeakyReLU());
  }
}

}  // namespace

torch::nn::Sequential unet(
    int64_t B,
    int64_t C,
    int64_t in_channels,
    int64_t out_channels,
    const UNetOptions& options) {
  check_arguments(B, C, in_channels, out_channels, options);
  const int64_t depth = options.depth();
  const auto plan = cells(C, in_channels, options);
  std::vector<Namespace> namespaces(depth);

  nn::Sequential net;
  for (const auto i : c10::irange(depth)) {
    const std::string level = "encoder" + std::to_string(i);
    add_cell(net, level, plan[i], B, options.dropout());
    detail::Stash skip("skip");
    skip->isolate(namespaces[i]);
    net->push_back(level + "_skip", skip);
    net->push_back(
        level + "_down", nn::MaxPool2d(nn::MaxPool2dOptions(2).stride(2)));
  }
  add_cell(net, "bottleneck", plan[depth], B, options.dropout());
  for (int64_t i = depth - 1; i >= 0; --i) {
    const std::string level = "decoder" + std::to_string(i);
    net->push_back(
        level + "_up",
        nn::Upsample(nn::UpsampleOptions()
                         .scale_factor(std::vector<double>{2, 2})
                         .mode(torch::kNearest)));
    PopCat skip;
    skip->isolate(namespaces[i]);
    net->push_back(level + "_skip", skip);
    add_cell(net, level, plan[2 * depth - i], B, options.dropout());
  }
  net->push_back(
      "segment",
      nn::Conv2d(
          nn::Conv2dOptions(plan.back().out, out_channels, 1).bias(false)));
  return net;
}

int64_t unet_parameter_count(
    int64_t B,
    int64_t C,
    int64_t in_channels,
    int64_t out_channels,
    const UNetOptions& options) {
  check_arguments(B, C, in_channels, out_channels, options);
  // Every product and sum checked: sizes the model takes can make a count
  // past int64 (depth 30, or C = 2^40).
  bool overflow = false;
  auto mul = [&overflow](int64_t a, int64_t b) {
    int64_t r = 0;
    overflow = overflow || __builtin_mul_overflow(a, b, &r);
    return r;
  };
  auto add = [&overflow](int64_t a, int64_t b) {
    int64_t r = 0;
    overflow = overflow || __builtin_add_overflow(a, b, &r);
    return r;
  };
  int64_t count = 0;
  for (const auto& cell : cells(C, in_channels, options)) {
    // 3x3 convolutions: in -> mid, (B - 2) x mid -> mid, mid -> out; a
    // single one goes in -> out.
    if (B == 1) {
      count = add(count, mul(9, mul(cell.in, cell.out)));
    } else {
      const auto middle = mul(B - 2, mul(cell.mid, cell.mid));
      count =
          add(count,
              mul(9,
                  add(add(mul(cell.in, cell.mid), middle),
                      mul(cell.mid, cell.out))));
    }
  }
  count = add(count, mul(C / 2, out_channels));
  TORCH_CHECK_VALUE(
      !overflow,
      "unet_parameter_count: the count for B = ",
      B,
      ", C = ",
      C,
      ", in_channels = ",
      in_channels,
      ", out_channels = ",
      out_channels,
      ", depth ",
      options.depth(),
      " does not fit in int64");
  return count;
}

}  // namespace gpipe::models
