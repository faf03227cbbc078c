// Reference models (gpipe::models): parameter counts against the published
// ones, layouts, output shapes as plain Sequentials, and outputs and
// gradients through GPipe with skips (or tuples) across the partition
// boundary, against the plain model.

#include <gpipe/gpipe.h>
#include <gpipe/models/amoebanet.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/timed.h>
#include <gpipe/models/unet.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"

namespace gpipe {
namespace {

using testing::copy_of;
using testing::SeededTest;

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& p : module.parameters()) {
    count += p.numel();
  }
  return count;
}

// Skips stashed by the first `head` layers of `net` and popped by a later
// one: the skips a cut after layer `head` carries across.
int64_t skips_across(const torch::nn::Sequential& net, int64_t head) {
  std::set<SkipKey> stashed;
  int64_t across = 0;
  int64_t index = 0;
  for (const auto& layer : net->children()) {
    if (const auto* skippable = as_skippable(*layer)) {
      if (index < head) {
        for (const auto& key : skippable->stashable()) {
          stashed.insert(key);
        }
      } else {
        for (const auto& key : skippable->poppable()) {
          across += static_cast<int64_t>(stashed.count(key));
        }
      }
    }
    ++index;
  }
  return across;
}

// Layers that stash and layers that pop.
std::pair<int64_t, int64_t> stashes_and_pops(const torch::nn::Sequential& net) {
  int64_t stashes = 0;
  int64_t pops = 0;
  for (const auto& layer : net->children()) {
    if (const auto* skippable = as_skippable(*layer)) {
      stashes += static_cast<int64_t>(skippable->stashable_names().size());
      pops += static_cast<int64_t>(skippable->poppable_names().size());
    }
  }
  return {stashes, pops};
}

// Tensors by name, without GPipe's "partitions.<j>." prefix.
std::map<std::string, torch::Tensor> by_layer_name(
    const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::map<std::string, torch::Tensor> result;
  for (const auto& item : named) {
    std::string name = item.key();
    const std::string prefix = "partitions.";
    if (name.compare(0, prefix.size(), prefix) == 0) {
      name = name.substr(name.find('.', prefix.size()) + 1);
    }
    result.emplace(name, item.value());
  }
  return result;
}

void expect_close(
    const torch::Tensor& expected,
    const torch::Tensor& actual,
    const std::string& what) {
  ASSERT_EQ(expected.defined(), actual.defined()) << what;
  if (!expected.defined()) {
    return;
  }
  ASSERT_EQ(expected.sizes(), actual.sizes()) << what;
  EXPECT_TRUE(torch::allclose(expected, actual, /*rtol=*/1e-7, /*atol=*/1e-9))
      << what << ": largest difference "
      << (expected - actual).abs().max().item<double>();
}

struct PipeCase {
  int64_t chunks;
  Checkpoint checkpoint;
  bool train;
};

std::string describe(const PipeCase& c) {
  return std::string(c.train ? "train" : "eval") +
         ", chunks=" + std::to_string(c.chunks) +
         ", checkpoint=" + to_string(c.checkpoint);
}

// Runs `net` (float64) plainly, one micro-batch after the other (BatchNorm
// in train mode normalises each micro-batch by itself inside GPipe too), and
// through GPipe with `balance`, and expects the same output, input gradient,
// parameter gradients and buffers (BatchNorm's running statistics).
void expect_gpipe_equals_plain(
    const torch::nn::Sequential& net,
    const torch::Tensor& input,
    const std::vector<int64_t>& balance,
    const PipeCase& c) {
  SCOPED_TRACE(describe(c));
  auto plain = copy_of(net);
  auto piped = copy_of(net);
  plain->train(c.train);

  auto x_plain = input.clone().requires_grad_(true);
  std::vector<torch::Tensor> outputs;
  for (const auto& micro : x_plain.chunk(c.chunks)) {
    outputs.push_back(plain->forward(micro));
  }
  const auto out_plain = torch::cat(outputs);
  // A loss that weighs every output differently, so that a permuted or
  // misrouted gradient shows.
  const auto weight = torch::randn_like(out_plain);
  (out_plain * weight).sum().backward();

  GPipe model(
      piped, GPipeOptions(balance).chunks(c.chunks).checkpoint(c.checkpoint));
  model->train(c.train);
  auto x_piped = input.clone().requires_grad_(true);
  const auto out_piped = model->forward(x_piped);
  (out_piped * weight).sum().backward();

  expect_close(out_plain, out_piped, "output");
  ASSERT_TRUE(x_plain.grad().defined());
  expect_close(x_plain.grad(), x_piped.grad(), "input gradient");

  const auto params_plain = by_layer_name(plain->named_parameters());
  const auto params_piped = by_layer_name(model->named_parameters());
  ASSERT_EQ(params_plain.size(), params_piped.size());
  for (const auto& [name, p] : params_plain) {
    ASSERT_EQ(params_piped.count(name), 1u) << name;
    // Every parameter of these models takes part in the output.
    ASSERT_TRUE(p.grad().defined()) << name;
    expect_close(p.grad(), params_piped.at(name).grad(), name + ".grad");
  }
  const auto buffers_plain = by_layer_name(plain->named_buffers());
  const auto buffers_piped = by_layer_name(model->named_buffers());
  ASSERT_EQ(buffers_plain.size(), buffers_piped.size());
  for (const auto& [name, b] : buffers_plain) {
    ASSERT_EQ(buffers_piped.count(name), 1u) << name;
    expect_close(b, buffers_piped.at(name), name);
  }
}

// Train mode with one micro-batch, checkpointed and not; train mode with
// checkpointed and plain micro-batches; eval mode with micro-batches.
const std::vector<PipeCase> kPipeCases = {
    {1, Checkpoint::Always, true},
    {1, Checkpoint::Never, true},
    {2, Checkpoint::ExceptLast, true},
    {2, Checkpoint::Never, false},
};

// --- ResNet ---------------------------------------------------------------

TEST_F(SeededTest, ResNet101HasTorchvisionParameterCount) {
  auto net = models::resnet101();
  EXPECT_EQ(parameter_count(*net), 44549160);
  // torchgpipe's ResNet-101 balances ([370], [135, 235], ...) count these.
  EXPECT_EQ(net->size(), 370u);
  EXPECT_EQ(
      parameter_count(*models::resnet101(/*num_classes=*/10)),
      44549160 - 2048 * 990 - 990);
}

TEST_F(SeededTest, ResNet101FlattensEveryBottleneckWithItsOwnSkip) {
  auto net = models::resnet101();
  // 33 bottlenecks, each stashing and popping "identity" in its namespace.
  EXPECT_EQ(stashes_and_pops(net), (std::pair<int64_t, int64_t>(33, 33)));
  EXPECT_NO_THROW(verify_skippables(net));
  EXPECT_EQ(net->named_children()[4].key(), "layer1_0_identity");
  EXPECT_EQ(net->named_children()[13].key(), "layer1_0_residual");
  EXPECT_EQ(net->named_children()[369].key(), "fc");
  // A cut inside the first block carries its identity across.
  EXPECT_EQ(skips_across(net, 8), 1);
  EXPECT_EQ(skips_across(net, 4), 0);
}

TEST_F(SeededTest, ResNet101RunsAsAPlainSequential) {
  auto net = models::resnet101();
  net->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({1, 3, 64, 64});
  const auto y = net->forward(x);
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({1, 1000}));
  // Nothing stays stashed between calls: a second run gives the same.
  EXPECT_TRUE(torch::equal(y, net->forward(x)));
}

TEST_F(SeededTest, SmallResNetShapeAndParameterCount) {
  auto net = models::resnet_small();
  EXPECT_EQ(net->size(), 3u + 3 * 11 + 3);
  // By hand: stem conv 1x8x3x3 and BN; per bottleneck (in, planes, out =
  // 4 planes) the convolutions in*p + 9*p*p + p*out, the downsampling
  // in*out, and BN 2 per channel of p, p, out, out; fc 128 -> 10.
  auto block = [](int64_t in, int64_t p) {
    const int64_t out = 4 * p;
    return in * p + 9 * p * p + p * out + in * out + 2 * (2 * p + 2 * out);
  };
  const int64_t expected = 8 * 9 + 2 * 8 + block(8, 8) + block(32, 16) +
                           block(64, 32) + 128 * 10 + 10;
  EXPECT_EQ(expected, 33090);
  EXPECT_EQ(parameter_count(*net), expected);

  net->train();
  const auto y = net->forward(torch::randn({2, 1, 28, 28}));
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 10}));
}

TEST_F(SeededTest, ResNetRejectsBadShapes) {
  try {
    models::resnet({}, 10);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("at least one stage"), std::string::npos)
        << e.what();
  }
  try {
    models::resnet({2, 0}, 10);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("stage 1 has 0"), std::string::npos)
        << e.what();
  }
}

TEST_F(SeededTest, SmallResNetThroughGPipeEqualsPlain) {
  auto net = models::resnet_small();
  net->to(torch::kFloat64);
  // Partition 0 ends inside the second bottleneck (its identity, conv1,
  // bn1 and relu1): the identity crosses.
  const std::vector<int64_t> balance = {18, 21};
  ASSERT_EQ(skips_across(net, balance[0]), 1);
  const auto x = torch::randn({4, 1, 28, 28}, torch::kFloat64);
  for (const auto& c : kPipeCases) {
    expect_gpipe_equals_plain(net, x, balance, c);
  }
}

// The downsampling BatchNorm sits inside a Residual (so that ResNet-101
// keeps torchgpipe's 370 layers); Residual converts itself.
TEST_F(SeededTest, SmallResNetTakesDeferredBatchNorm) {
  auto net = models::resnet_small();
  net->to(torch::kFloat64);
  auto plain = testing::copy_of(net);
  GPipe model(net, GPipeOptions({18, 21}).chunks(4).deferred_batch_norm(true));
  int64_t batch_norms = 0;
  for (const auto& m : net->modules()) {
    batch_norms += m->as<torch::nn::BatchNorm2dImpl>() != nullptr;
  }
  int64_t deferred = 0;
  for (const auto& m : model->modules()) {
    deferred += m->as<DeferredBatchNormImpl>() != nullptr;
  }
  EXPECT_EQ(batch_norms, 13);  // 3 per bottleneck, 3 downsamplings, stem
  EXPECT_EQ(deferred, batch_norms);
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({8, 1, 28, 28}, torch::kFloat64);
    plain->forward(x).sum().backward();
    model->forward(x).sum().backward();
  }
  // Every BatchNorm, the downsampling ones included, updated its running
  // statistics once per mini-batch, not once per micro-batch; the stem's,
  // whose input is the plain model's, to the plain model's values.
  auto expected = plain->named_buffers();
  auto got = net->named_buffers();  // shared with the GPipe's layers
  ASSERT_EQ(expected.size(), got.size());
  int64_t counters = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    const auto& name = got[k].key();
    if (name.find("num_batches_tracked") != std::string::npos) {
      EXPECT_EQ(got[k].value().item<int64_t>(), 2) << name;
      ++counters;
    } else if (name.rfind("bn1.", 0) == 0) {
      EXPECT_TRUE(
          torch::allclose(got[k].value(), expected[k].value(), 1e-10, 1e-12))
          << name;
    }
  }
  EXPECT_EQ(counters, 13);
  // The plain model (the user's layers) keeps its own BatchNorms.
  for (const auto& m : net->modules()) {
    EXPECT_EQ(m->as<DeferredBatchNormImpl>(), nullptr) << m->name();
  }
}

TEST_F(SeededTest, ImageNetStemResNetThroughGPipeEqualsPlain) {
  // The 7x7 stem and max-pool, two stages of two blocks of width 4.
  auto net = models::resnet({2, 2}, 5, models::ResNetOptions().width(4));
  net->to(torch::kFloat64);
  // The cut falls after the first block's conv2: its downsampled identity
  // (stashed before the cut, downsampled after it) crosses.
  const std::vector<int64_t> balance = {9, 42};
  ASSERT_EQ(net->size(), 51u);
  ASSERT_EQ(skips_across(net, balance[0]), 1);
  const auto x = torch::randn({4, 3, 32, 32}, torch::kFloat64);
  for (const auto& c : kPipeCases) {
    expect_gpipe_equals_plain(net, x, balance, c);
  }
}

// --- U-Net ----------------------------------------------------------------

TEST_F(SeededTest, UNetParameterCountsMatchTorchgpipe) {
  // torchgpipe's U-Net memory benchmark: (B, C) = (6, 72) 362.2M and
  // (11, 128) 2.21B parameters. The latter would take 8.9 GB to build.
  EXPECT_EQ(models::unet_parameter_count(6, 72), 362157516);
  EXPECT_EQ(models::unet_parameter_count(11, 128), 2213834176);
  // Counted by hand for U-Net(2, 4): 3x3 convolutions (in*mid + mid*out)
  // per cell, encoder 3-4-4, 4-8-8, 8-16-16, 16-32-32, 32-64-64;
  // bottleneck 64-128-64; decoder 128-32-32, 64-16-16, 32-8-8, 16-4-4,
  // 8-2-2; then 2 x 1 for the 1x1 segment convolution.
  const int64_t by_hand =
      9 * ((3 * 4 + 4 * 4) + (4 * 8 + 8 * 8) + (8 * 16 + 16 * 16) +
           (16 * 32 + 32 * 32) + (32 * 64 + 64 * 64) + (64 * 128 + 128 * 64) +
           (128 * 32 + 32 * 32) + (64 * 16 + 16 * 16) + (32 * 8 + 8 * 8) +
           (16 * 4 + 4 * 4) + (8 * 2 + 2 * 2)) +
      2;
  EXPECT_EQ(by_hand, 282530);
  EXPECT_EQ(models::unet_parameter_count(2, 4), by_hand);
  EXPECT_EQ(parameter_count(*models::unet(2, 4)), by_hand);
}

TEST_F(SeededTest, UNetParameterCountFunctionMatchesBuiltModels) {
  // (B, C, in, out, depth), with odd C (level 0 ends with C / 2 channels)
  // and a single convolution per cell.
  const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>
      cases = {
          {1, 2, 1, 1, 5},
          {2, 5, 3, 1, 5},
          {3, 7, 2, 3, 5},
          {4, 6, 3, 2, 3},
          {2, 8, 1, 16, 1},
      };
  for (const auto& [B, C, in, out, depth] : cases) {
    const auto options = models::UNetOptions().depth(depth);
    EXPECT_EQ(
        parameter_count(*models::unet(B, C, in, out, options)),
        models::unet_parameter_count(B, C, in, out, options))
        << "B=" << B << " C=" << C << " in=" << in << " out=" << out
        << " depth=" << depth;
  }
}

TEST_F(SeededTest, UNet6x72IsBuiltWithThePublishedParameterCount) {
  // 1.45 GB of float32 parameters; a few seconds.
  auto net = models::unet(6, 72);
  EXPECT_EQ(parameter_count(*net), 362157516);
  // torchgpipe's pipeline balances for U-Net(B, C) sum to 44 B + 21.
  EXPECT_EQ(net->size(), 44u * 6 + 21);
}

TEST_F(SeededTest, UNetLongSkipsPairEncoderWithDecoder) {
  auto net = models::unet(2, 4);
  EXPECT_EQ(net->size(), 44u * 2 + 21);
  EXPECT_EQ(stashes_and_pops(net), (std::pair<int64_t, int64_t>(5, 5)));
  EXPECT_NO_THROW(verify_skippables(net));
  // Cut in the bottleneck: all five long skips cross.
  EXPECT_EQ(skips_across(net, 54), 5);
  // Cut after the first encoder level's stash: only that one crosses.
  EXPECT_EQ(skips_across(net, 9), 1);
}

TEST_F(SeededTest, UNetRunsAsAPlainSequential) {
  auto net = models::unet(2, 4);
  net->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 3, 32, 32});
  const auto y = net->forward(x);
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 1, 32, 32}));
  EXPECT_TRUE(torch::equal(y, net->forward(x)));
  // 36 -> 18 -> 9 -> 4 -> 2 -> 1: upsampling 4 back gives 8 where the skip
  // has 9, and PopCat pads it.
  auto wide = models::unet(1, 4, /*in_channels=*/1, /*out_channels=*/3);
  wide->eval();
  EXPECT_EQ(
      wide->forward(torch::randn({2, 1, 36, 36})).sizes(),
      torch::IntArrayRef({2, 3, 36, 36}));
}

TEST_F(SeededTest, UNetRejectsBadSizes) {
  try {
    models::unet(0, 8);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("expected B >= 1, but got 0"),
        std::string::npos)
        << e.what();
  }
  EXPECT_THROW(models::unet_parameter_count(2, 1), c10::ValueError);
  EXPECT_THROW(
      models::unet(2, 4, 3, 1, models::UNetOptions().dropout(1.5)),
      c10::ValueError);
  // Counts past int64 came back negative or wrapped (depth 30 is allowed).
  EXPECT_THROW(
      models::unet_parameter_count(1, 2, 3, 1, models::UNetOptions().depth(30)),
      c10::ValueError);
  EXPECT_THROW(
      models::unet_parameter_count(1, int64_t{1} << 40), c10::ValueError);
  EXPECT_THROW(
      models::unet_parameter_count(int64_t{1} << 62, 4), c10::ValueError);
  EXPECT_THROW(
      models::unet_parameter_count(
          1, int64_t{1} << 60, 3, 1, models::UNetOptions().depth(4)),
      c10::ValueError);
}

TEST_F(SeededTest, TimedLayerChecksItsArgumentsAndOutlivesNothing) {
  EXPECT_THROW(models::TimedLayer(-1), c10::ValueError);
  EXPECT_THROW(models::TimedLayer(0), c10::ValueError);
  EXPECT_THROW(
      models::TimedLayer(3, models::TimedCosts{std::chrono::microseconds(-5)}),
      c10::ValueError);
  // The backward of an output whose layer is gone read the layer's costs
  // and counts through pointers into it (freed memory, under valgrind and
  // ASan). It now holds what it needs.
  auto counts = std::make_shared<models::TimedCounts>();
  torch::Tensor out;
  const auto x = torch::randn({2, 3}, torch::requires_grad());
  {
    const std::chrono::microseconds none{0};
    models::TimedLayer layer(3, models::TimedCosts{none, none, none}, counts);
    out = layer->forward(x);
  }
  out.sum().backward();
  EXPECT_EQ(counts->forward.load(), 1);
  EXPECT_EQ(counts->backward_input.load(), 1);
  EXPECT_EQ(counts->backward_weight.load(), 1);
  EXPECT_TRUE(x.grad().equal(torch::ones({2, 3})));
}

TEST_F(SeededTest, UNetThroughGPipeEqualsPlain) {
  // Dropout 0: GPipe draws each cell's random numbers from a seed of its
  // own, so masks would differ from the plain model's.
  auto net = models::unet(2, 4, 3, 1, models::UNetOptions().dropout(0.0));
  net->to(torch::kFloat64);
  const std::vector<int64_t> balance = {54, 55};
  ASSERT_EQ(skips_across(net, balance[0]), 5);
  const auto x = torch::randn({4, 3, 32, 32}, torch::kFloat64);
  for (const auto& c : kPipeCases) {
    expect_gpipe_equals_plain(net, x, balance, c);
  }
}

// --- AmoebaNet-D ----------------------------------------------------------

TEST_F(SeededTest, AmoebaNetD18x208HasThePublishedParameterCount) {
  // torchgpipe reports 81.5M (the GPipe paper 82M) for AmoebaNet-D (18, 208).
  auto net = models::amoebanetd(18, 208);
  EXPECT_EQ(parameter_count(*net), 81505540);
  // torchgpipe's balances for L = 18 ([24], [16, 8]) count these.
  EXPECT_EQ(net->size(), 24u);
  EXPECT_EQ(net->named_children()[9].key(), "cell2_reduction");
}

TEST_F(SeededTest, SmallAmoebaNetDParameterCounts) {
  // Derived from the genotype (stem, cells, classifier) by a separate
  // count; these pin the channel bookkeeping at small sizes.
  EXPECT_EQ(parameter_count(*models::amoebanetd(3, 8, 10)), 26749);
  EXPECT_EQ(parameter_count(*models::amoebanetd(6, 16, 10)), 173894);
}

TEST_F(SeededTest, AmoebaNetDRunsAsAPlainSequential) {
  auto net = models::amoebanetd(3, 8, 10);
  EXPECT_EQ(net->size(), 9u);
  net->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 3, 224, 224});
  const auto y = net->forward(x);
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 10}));
  EXPECT_TRUE(torch::equal(y, net->forward(x)));
}

TEST_F(SeededTest, AmoebaNetDRejectsBadSizes) {
  try {
    models::amoebanetd(4, 208);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("multiple of 3, but got 4"),
        std::string::npos)
        << e.what();
  }
  EXPECT_THROW(models::amoebanetd(3, 4), c10::ValueError);
}

TEST_F(SeededTest, AmoebaNetDThroughGPipeEqualsPlain) {
  auto net = models::amoebanetd(3, 8, 10);
  net->to(torch::kFloat64);
  // The cut falls between cells: the pair (output, previous output) crosses.
  const std::vector<int64_t> balance = {4, 5};
  const auto x = torch::randn({4, 3, 224, 224}, torch::kFloat64);
  for (const auto& c : kPipeCases) {
    expect_gpipe_equals_plain(net, x, balance, c);
  }
}

}  // namespace
}  // namespace gpipe
