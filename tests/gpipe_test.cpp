// The GPipe module: construction checks, module behaviour, errors in flight.

#include <torch/csrc/autograd/function_hook.h>

#include <atomic>
#include <limits>
#include <sstream>

#include "common.h"

namespace {

using gpipe::Checkpoint;
using gpipe::GPipe;
using gpipe::GPipeOptions;
using gpipe::testing::copy_of;
using gpipe::testing::lambda;
using gpipe::testing::Raise;
using gpipe::testing::SeededTest;

class GPipeTest : public SeededTest {};

torch::nn::Sequential two_linears() {
  return torch::nn::Sequential(
      torch::nn::Linear(3, 3), torch::nn::Linear(3, 3));
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_F(GPipeTest, ExposesTheSequentialsParameters) {
  auto net = two_linears();
  GPipe model(net, GPipeOptions({1, 1}));
  auto a = net->parameters();
  auto b = model->parameters();
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_TRUE(a[k].is_same(b[k]));
  }
  auto names = model->named_parameters().keys();
  EXPECT_EQ(names[0], "partitions.0.0.weight");
  EXPECT_EQ(names[3], "partitions.1.1.bias");
}

// eval() and train() on the GPipe reached the layers but left the given
// Sequential's own flag as it was: `net->is_training()` said true after
// `model->eval()`.
TEST_F(GPipeTest, EvalAndTrainReachTheSequentialGiven) {
  torch::nn::Sequential net(
      torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4));
  GPipe model(net, GPipeOptions({2, 1}).chunks(2));
  model->eval();
  EXPECT_FALSE(model->is_training());
  EXPECT_FALSE(net->is_training());
  for (const auto& layer : net->children()) {
    EXPECT_FALSE(layer->is_training());
  }
  model->train();
  EXPECT_TRUE(net->is_training());
  EXPECT_TRUE(net[0]->is_training());
  net->eval();  // the other way: the layers are the GPipe's
  EXPECT_FALSE(model[0]->is_training());
}

// A GPipe made of a Sequential in eval() said is_training() true, while
// its passes ran every layer in eval(); it starts in eval() now. One layer
// left training keeps it training, and that layer too.
TEST_F(GPipeTest, AGPipeOfASequentialInEvalStartsInEval) {
  torch::nn::Sequential net(
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5),
      torch::nn::Linear(4, 4));
  net->eval();
  GPipe model(net, GPipeOptions({2, 1}).chunks(2));
  EXPECT_FALSE(model->is_training());
  model->train();
  EXPECT_TRUE(net[1]->is_training());

  torch::nn::Sequential mixed(
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5),
      torch::nn::Linear(4, 4));
  mixed->eval();
  mixed[1]->train();
  GPipe kept(mixed, GPipeOptions({2, 1}).chunks(2));
  EXPECT_TRUE(kept->is_training());
  EXPECT_TRUE(mixed[1]->is_training());
  EXPECT_FALSE(mixed[0]->is_training());
}

TEST_F(GPipeTest, PublicAttributes) {
  GPipe model(
      two_linears(),
      GPipeOptions({2}).chunks(42).checkpoint(Checkpoint::Never));
  EXPECT_EQ(model->balance(), (std::vector<int64_t>{2}));
  ASSERT_EQ(model->devices().size(), 1u);
  EXPECT_TRUE(model->devices()[0].is_cpu());
  EXPECT_EQ(model->chunks(), 42);
  EXPECT_EQ(model->checkpoint(), Checkpoint::Never);
  EXPECT_EQ(model->partitions()->size(), 1u);
  std::ostringstream s;
  s << *model;
  EXPECT_EQ(
      s.str().rfind(
          "gpipe::GPipe(balance=[2], chunks=42, checkpoint=never)", 0),
      0u)
      << s.str();
}

TEST_F(GPipeTest, IndexesLayersAcrossPartitions) {
  auto net = two_linears();
  for (auto balance : std::vector<std::vector<int64_t>>{{2}, {1, 1}}) {
    GPipe model(net, GPipeOptions(balance));
    EXPECT_EQ(model->size(), 2);
    EXPECT_EQ(model[0].get(), net->ptr(0).get());
    EXPECT_EQ(model[1].get(), net->ptr(1).get());
    EXPECT_EQ(model[-1].get(), net->ptr(1).get());
    EXPECT_EQ(model[-2].get(), net->ptr(0).get());
    EXPECT_THROW(model[2], c10::IndexError);
    EXPECT_THROW(model[-3], c10::IndexError);
  }
  // An empty model (taken, as torchgpipe takes it: forward returns the
  // input) has no layer to index ("expected -0 <= index < 0" before).
  GPipe empty(torch::nn::Sequential(), GPipeOptions(std::vector<int64_t>{}));
  const auto msg = message_of([&] { empty[0]; });
  EXPECT_TRUE(contains(msg, "the model has no layers, but got 0")) << msg;
}

// `options` is public: changing its layout after construction left
// balance(), size() and model[i] describing partitions the model did not
// have (model[-1] failed an internal assert, a checkpoint's manifest took
// the new balance) while the passes ran the old one.
TEST_F(GPipeTest, ALayoutChangedInOptionsIsRefusedAtTheNextPass) {
  torch::nn::Sequential net(
      torch::nn::Linear(3, 3), torch::nn::ReLU(), torch::nn::Linear(3, 3));
  GPipe model(net, GPipeOptions({2, 1}).chunks(2));
  const auto x = torch::randn({4, 3});
  model->options.balance({1, 2});
  EXPECT_EQ(model->balance(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(model->size(), 3);
  EXPECT_EQ(model[-1].get(), net->ptr(2).get());
  std::ostringstream printed;
  printed << *model;
  EXPECT_TRUE(contains(printed.str(), "balance=[2, 1]")) << printed.str();
  auto msg = message_of([&] { model->forward(x); });
  EXPECT_TRUE(contains(
      msg,
      "gpipe::GPipe was built with options.balance() [2, 1], but it is now "
      "[1, 2]"))
      << msg;
  EXPECT_THROW(model->forward(x), c10::ValueError);
  auto loss = [](torch::Tensor out, torch::Tensor target) {
    return torch::mse_loss(out, target);
  };
  EXPECT_THROW(model->train_step(x, x, loss), c10::ValueError);
  model->options.balance({2, 1}).stages_per_lane(2);
  msg = message_of([&] { model->forward_tuple(x); });
  EXPECT_TRUE(contains(msg, "options.stages_per_lane() 1, but it is now 2"))
      << msg;
  model->options.stages_per_lane(1).placement(gpipe::Placement({1, 0}));
  msg = message_of([&] { model->forward(std::vector<torch::Tensor>{x}); });
  EXPECT_TRUE(contains(msg, "options.placement() none, but it is now")) << msg;
  // Set back, the model runs; chunks and checkpoint may change.
  model->options.placement(gpipe::Placement());
  model->options.chunks(4).checkpoint(Checkpoint::Never);
  EXPECT_TRUE(torch::allclose(model->forward(x), net->forward(x)));
  EXPECT_EQ(model->chunks(), 4);
}

// A hook on a parameter runs once per micro-batch, on that micro-batch's
// part of the gradient (the guide, section 2): a hook that scales gives the
// plain model's .grad, one that clips does not.
TEST_F(GPipeTest, AParameterHookRunsOncePerMicroBatch) {
  auto net = two_linears();
  auto plain = copy_of(net);
  GPipe model(net, GPipeOptions({1, 1}).chunks(4));
  std::atomic<int> calls{0};
  net[0]->parameters()[0].register_hook([&](torch::Tensor g) {
    ++calls;
    return g * 0.5;
  });
  plain[0]->parameters()[0].register_hook(
      [](torch::Tensor g) { return g * 0.5; });
  const auto x = torch::randn({8, 3});
  model->forward(x).pow(2).sum().backward();
  plain->forward(x).pow(2).sum().backward();
  EXPECT_EQ(calls.load(), 4);
  EXPECT_TRUE(torch::allclose(
      net[0]->parameters()[0].grad(),
      plain[0]->parameters()[0].grad(),
      1e-5,
      1e-6));
}

TEST_F(GPipeTest, BalanceOfWrongLengthIsRefusedWithAdvice) {
  for (auto balance : std::vector<std::vector<int64_t>>{{1}, {3}}) {
    EXPECT_THROW(GPipe(two_linears(), GPipeOptions(balance)), c10::ValueError);
  }
  auto msg = message_of([] { GPipe(two_linears(), GPipeOptions({3})); });
  EXPECT_TRUE(contains(msg, "number of layers (2)")) << msg;
  EXPECT_TRUE(contains(msg, "got 3")) << msg;
  EXPECT_TRUE(contains(msg, "balance_by_time")) << msg;
}

TEST_F(GPipeTest, BalanceBelowOneIsRefused) {
  for (auto balance : std::vector<std::vector<int64_t>>{{0, 2}, {-1, 3}}) {
    auto msg = message_of([&] { GPipe(two_linears(), GPipeOptions(balance)); });
    EXPECT_TRUE(contains(msg, "positive integer")) << msg;
    EXPECT_TRUE(contains(msg, "balance_by_time")) << msg;
    EXPECT_THROW(GPipe(two_linears(), GPipeOptions(balance)), c10::ValueError);
  }
}

TEST_F(GPipeTest, ChunksBelowOneAreRefused) {
  EXPECT_THROW(
      GPipe(two_linears(), GPipeOptions({2}).chunks(0)), c10::ValueError);
  EXPECT_THROW(
      GPipe(two_linears(), GPipeOptions({2}).chunks(-1)), c10::ValueError);
}

// A balance whose sum overflows int64 wrapped round to the layer count,
// passed the check, and ended in an internal assertion.
TEST_F(GPipeTest, ABalanceWhoseSumOverflowsIsRefused) {
  const auto huge = std::numeric_limits<int64_t>::max();
  auto msg = message_of([&] {
    GPipe(two_linears(), GPipeOptions({huge, huge, 4}));
  });
  EXPECT_TRUE(contains(msg, "a sum beyond int64's range")) << msg;
  EXPECT_THROW(
      GPipe(two_linears(), GPipeOptions({huge, huge, 4})), c10::ValueError);
  EXPECT_THROW(gpipe::verify_balance({huge, huge, 4}, 2), c10::ValueError);
}

// verify_devices took a negative number of partitions as nothing to check.
TEST_F(GPipeTest, VerifyDevicesRefusesANegativeNumberOfPartitions) {
  auto msg = message_of([] { gpipe::verify_devices({torch::kCPU}, -1); });
  EXPECT_TRUE(contains(
      msg, "verify_devices expects a number of lanes >= 0, but got -1"))
      << msg;
  EXPECT_NO_THROW(gpipe::verify_devices({torch::kCPU}, 0));
  // It counts lanes, as the constructor does: a placement of 4 partitions
  // on 2 lanes needs 2 devices.
  const auto placement = gpipe::Placement({0, 0, 1, 1});
  EXPECT_NO_THROW(
      gpipe::verify_devices({torch::kCPU, torch::kCPU}, placement.lanes()));
  EXPECT_NO_THROW(GPipe(
      copy_of(torch::nn::Sequential(
          torch::nn::Linear(2, 2),
          torch::nn::Linear(2, 2),
          torch::nn::Linear(2, 2),
          torch::nn::Linear(2, 2))),
      GPipeOptions({1, 1, 1, 1})
          .placement(placement)
          .devices({torch::kCPU, torch::kCPU})));
}

// Chunks near INT64_MAX: the first forward divided by zero (SIGFPE) on an
// input without grad, and failed in Tensor::chunk on one with grad; any
// chunks above the batch's rows cut one row a micro-batch.
TEST_F(GPipeTest, ChunksFarAboveTheBatchCutOneRowEach) {
  const auto huge = std::numeric_limits<int64_t>::max();
  for (const int64_t chunks : {huge, huge - 4, int64_t{1} << 62}) {
    EXPECT_EQ(gpipe::scatter({torch::zeros({6, 4})}, chunks).size(), 6u);
    EXPECT_EQ(
        gpipe::scatter({torch::zeros({6, 4}).requires_grad_()}, chunks).size(),
        6u);
  }
  auto net = two_linears();
  net->to(torch::kFloat64);
  auto plain = gpipe::testing::copy_of(net);
  GPipe model(net, GPipeOptions({1, 1}).chunks(huge));
  const auto x = torch::randn({6, 3}, torch::kFloat64);
  model->forward(x).sum().backward();
  plain->forward(x).sum().backward();
  gpipe::testing::expect_same_gradients(*plain, *net);
}

// A Checkpoint cast from an integer outside the enum ran as if it were
// Never, and printing the model then failed an internal assertion.
TEST_F(GPipeTest, ACheckpointModeOutsideTheEnumIsRefused) {
  const auto bad = static_cast<gpipe::Checkpoint>(42);
  auto msg = message_of([&] {
    GPipe(two_linears(), GPipeOptions({1, 1}).checkpoint(bad));
  });
  EXPECT_TRUE(contains(msg, "but got Checkpoint(42)")) << msg;
  EXPECT_THROW(
      GPipe(two_linears(), GPipeOptions({1, 1}).checkpoint(bad)),
      c10::ValueError);
  // Set between passes: refused at the next pass, usable once put back.
  GPipe model(two_linears(), GPipeOptions({1, 1}).chunks(2));
  model->options.checkpoint(bad);
  EXPECT_THROW(model->forward(torch::randn({4, 3})), c10::ValueError);
  std::ostringstream printed;
  printed << *model;
  EXPECT_TRUE(contains(printed.str(), "checkpoint=unknown")) << printed.str();
  model->options.checkpoint(gpipe::Checkpoint::Always);
  EXPECT_NO_THROW(model->forward(torch::randn({4, 3})).sum().backward());
}

TEST_F(GPipeTest, TooFewDevicesAreRefused) {
  torch::nn::Sequential net{
      torch::nn::Identity{},
      torch::nn::Identity{},
      torch::nn::Identity{},
      torch::nn::Identity{}};
  auto make = [&] {
    GPipe(net, GPipeOptions({1, 1, 1, 1}).devices({torch::kCPU}));
  };
  EXPECT_THROW(make(), c10::IndexError);
  EXPECT_TRUE(contains(message_of(make), "got 1")) << message_of(make);
}

TEST_F(GPipeTest, AnUnreachableCudaDeviceIsRefusedFirst) {
  // Before anything is placed, with one line that says why, rather than
  // LibTorch's dispatcher dump from the first copy.
  auto net = two_linears();
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  const torch::Device beyond(
      torch::kCUDA, static_cast<c10::DeviceIndex>(count));
  auto make = [&] {
    GPipe(net, GPipeOptions({1, 1}).devices({torch::kCPU, beyond}));
  };
  const auto msg = message_of(make);
  if (at::hasCUDA()) {
    EXPECT_THROW(make(), c10::IndexError);
    EXPECT_TRUE(contains(msg, "devices[1] is cuda:")) << msg;
  } else {
    EXPECT_THROW(make(), c10::ValueError);
    EXPECT_TRUE(
        contains(msg, "this LibTorch has no CUDA: devices[1] is cuda:0"))
        << msg;
  }
  // Nothing moved: the Sequential still runs on the CPU.
  EXPECT_EQ(net->parameters()[0].device(), torch::Device(torch::kCPU));
}

TEST_F(GPipeTest, ADeviceOtherThanCpuOrCudaIsRefusedFirst) {
  // A meta device used to fail when the first parameter moved, with
  // autograd's "incompatible tensor type" and no word of the option.
  auto net = two_linears();
  auto make = [&] {
    GPipe(
        net,
        GPipeOptions({1, 1}).devices({torch::kCPU, torch::Device("meta")}));
  };
  EXPECT_THROW(make(), c10::ValueError);
  const auto msg = message_of(make);
  EXPECT_TRUE(contains(
      msg, "devices[1] must be the CPU or a CUDA device, but got meta"))
      << msg;
  EXPECT_EQ(net->parameters()[0].device(), torch::Device(torch::kCPU));
}

// A layer pushed back onto the Sequential after the GPipe was built ran
// nowhere: the output had the old last layer's shape, and the new layer's
// parameters were not the GPipe's. Every pass, and clone, now refuse it.
TEST_F(GPipeTest, ALayerAddedToTheSequentialAfterwardsIsRefused) {
  torch::nn::Sequential net(
      torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4));
  GPipe model(net, GPipeOptions({2, 1}).chunks(2));
  const auto x = torch::randn({4, 4});
  model->forward(x);
  net->push_back(torch::nn::Linear(4, 2));
  const std::string expected =
      "gpipe::GPipe was built over a Sequential of 3 layers, but it has 4 now";
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { model->forward(x); },
           [&] { model->forward_tuple(x); },
           [&] { model->forward(std::vector<torch::Tensor>{x}); },
           [&] {
             model->train_step(x, torch::randn({4, 2}), [](auto y, auto t) {
               return torch::mse_loss(y, t);
             });
           },
           [&] { model->clone(); }}) {
    EXPECT_THROW(call(), c10::ValueError);
    const auto msg = message_of(call);
    EXPECT_TRUE(contains(msg, expected)) << msg;
  }
}

TEST_F(GPipeTest, ExtraDevicesAreDropped) {
  torch::nn::Sequential net{
      torch::nn::Identity{}, torch::nn::Identity{}, torch::nn::Identity{}};
  GPipe model(
      net,
      GPipeOptions({1, 1, 1}).devices(
          {torch::kCPU, torch::kCPU, torch::kCPU, torch::kCPU, torch::kCPU}));
  EXPECT_EQ(model->devices().size(), 3u);
}

TEST_F(GPipeTest, CheckpointNamesParse) {
  EXPECT_EQ(gpipe::checkpoint_from_string("always"), Checkpoint::Always);
  EXPECT_EQ(
      gpipe::checkpoint_from_string("except_last"), Checkpoint::ExceptLast);
  EXPECT_EQ(gpipe::checkpoint_from_string("never"), Checkpoint::Never);
  auto msg = message_of([] { gpipe::checkpoint_from_string("sometimes"); });
  EXPECT_TRUE(contains(msg, "'always', 'except_last' or 'never'")) << msg;
}

TEST_F(GPipeTest, SameModuleTwiceIsRefused) {
  torch::nn::Linear shared(2, 2);
  torch::nn::Sequential net(shared, shared);
  auto msg = message_of([&] { GPipe(net, GPipeOptions({1, 1})); });
  EXPECT_TRUE(contains(msg, "same module twice")) << msg;
  EXPECT_THROW(GPipe(net, GPipeOptions({1, 1})), c10::ValueError);
}

TEST_F(GPipeTest, SharedParametersBetweenChildrenAreRefused) {
  struct HoldImpl : torch::nn::Module {
    explicit HoldImpl(torch::Tensor w) {
      register_parameter("w", w);
    }
    torch::Tensor forward(torch::Tensor x) {
      return x;
    }
  };
  torch::nn::Linear a(2, 2);
  torch::nn::Sequential net(a, std::make_shared<HoldImpl>(a->weight));
  auto msg = message_of([&] { GPipe(net, GPipeOptions({1, 1})); });
  EXPECT_TRUE(contains(msg, "share parameters")) << msg;
}

TEST_F(GPipeTest, IndivisibleAndSmallBatchesWork) {
  GPipe model(two_linears(), GPipeOptions({1, 1}).chunks(4));
  EXPECT_EQ(model->forward(torch::randn({7, 3})).size(0), 7);
  EXPECT_EQ(model->forward(torch::randn({2, 3})).size(0), 2);
}

TEST_F(GPipeTest, BadInputsAreRefused) {
  GPipe model(two_linears(), GPipeOptions({1, 1}).chunks(2));
  EXPECT_THROW(model->forward(torch::randn({0, 3})), c10::ValueError);
  EXPECT_THROW(model->forward(torch::Tensor()), c10::TypeError);
  EXPECT_THROW(model->forward(std::vector<torch::Tensor>{}), c10::ValueError);
  auto msg = message_of([&] {
    model->forward(
        std::vector<torch::Tensor>{torch::randn({4, 3}), torch::randn({5, 3})});
  });
  EXPECT_TRUE(contains(msg, "same batch size")) << msg;
}

TEST_F(GPipeTest, ExceptionNamesPartitionAndMicroBatch) {
  std::atomic<int> counter{0};
  auto count = lambda([&](torch::Tensor x) {
    ++counter;
    return x;
  });
  torch::nn::Sequential net(
      count, torch::nn::Identity(), torch::nn::Identity(), Raise());
  GPipe model(net, GPipeOptions({1, 1, 1, 1}).chunks(3));
  try {
    model->forward(torch::randn({3, 2}));
    FAIL() << "no exception";
  } catch (const c10::Error& e) {
    std::string what = e.what();
    EXPECT_TRUE(contains(what, "boom")) << what;
    EXPECT_TRUE(contains(what, "partition 3, micro-batch 0, forward")) << what;
  }
  // Lanes run ahead of the failing cell (no lockstep), so the first
  // partition saw at least micro-batch 0 and at most all three.
  EXPECT_GE(counter.load(), 1);
  EXPECT_LE(counter.load(), 3);
}

TEST_F(GPipeTest, CellsAfterAFailureNeverStart) {
  std::atomic<int> after{0};
  auto count = lambda([&](torch::Tensor x) {
    ++after;
    return x;
  });
  torch::nn::Sequential net(Raise(), count);
  GPipe model(net, GPipeOptions({1, 1}).chunks(4));
  EXPECT_THROW(model->forward(torch::randn({4, 2})), c10::Error);
  EXPECT_EQ(after.load(), 0);
}

TEST_F(GPipeTest, ModelWorksAgainAfterAnException) {
  auto raise = Raise();
  torch::nn::Sequential net(torch::nn::Linear(2, 2), torch::nn::ReLU(), raise);
  GPipe model(net, GPipeOptions({1, 1, 1}).chunks(3));
  for (int k = 0; k < 20; ++k) {
    EXPECT_THROW(model->forward(torch::randn({6, 2})), c10::Error);
  }
  raise->armed = false;
  auto y = model->forward(torch::randn({6, 2}));
  y.sum().backward();
  EXPECT_TRUE(net[0]->as<torch::nn::Linear>()->weight.grad().defined());
}

TEST_F(GPipeTest, ExceptionInBackwardReachesTheCaller) {
  auto fail = lambda([](torch::Tensor x) {
    auto y = x * 1.0;
    if (y.requires_grad()) {  // not while checkpointing
      y.register_hook([](torch::Tensor g) -> torch::Tensor {
        TORCH_CHECK_VALUE(false, "backward failed");
      });
    }
    return y;
  });
  torch::nn::Sequential net(
      torch::nn::Linear(2, 2), fail, torch::nn::Linear(2, 2));
  GPipe model(net, GPipeOptions({1, 1, 1}).chunks(2));
  auto y = model->forward(torch::randn({4, 2}));
  auto msg = message_of([&] { y.sum().backward(); });
  EXPECT_TRUE(contains(msg, "backward failed")) << msg;
  EXPECT_TRUE(contains(msg, "partition 1")) << msg;
  EXPECT_TRUE(contains(msg, "backward")) << msg;
  // Still usable.
  auto z = model->forward(torch::randn({4, 2}));
  EXPECT_EQ(z.size(0), 4);
}

TEST_F(GPipeTest, FailedBackwardLeavesRunningStatsAsForwardLeftThem) {
  // The recomputation updates BatchNorm's running statistics again; they
  // must be put back even when the cell's backward then fails.
  auto fail = lambda([](torch::Tensor x) {
    auto y = x * 1.0;
    if (y.requires_grad()) {  // only in the recomputation
      y.register_hook([](torch::Tensor g) -> torch::Tensor {
        TORCH_CHECK_VALUE(false, "backward failed");
      });
    }
    return y;
  });
  torch::nn::BatchNorm1d bn(2);
  torch::nn::Sequential net(
      torch::nn::Linear(2, 2), bn, fail, torch::nn::Linear(2, 2));
  GPipe model(
      net, GPipeOptions({3, 1}).chunks(2).checkpoint(Checkpoint::Always));
  auto y = model->forward(torch::randn({4, 2}));
  const auto mean = bn->running_mean.clone();
  const auto var = bn->running_var.clone();
  EXPECT_THROW(y.sum().backward(), c10::ValueError);
  EXPECT_TRUE(torch::equal(bn->running_mean, mean));
  EXPECT_TRUE(torch::equal(bn->running_var, var));
}

TEST_F(GPipeTest, TupleBatchesFlowThroughPartitions) {
  struct PairImpl : torch::nn::Module {
    std::vector<torch::Tensor> forward(std::vector<torch::Tensor> xs) {
      return {xs[0] * 2, xs[1] + xs[0]};
    }
  };
  torch::nn::Sequential net(
      std::make_shared<PairImpl>(), std::make_shared<PairImpl>());
  GPipe model(net, GPipeOptions({1, 1}).chunks(2));
  auto a = torch::randn({4, 2}, torch::requires_grad());
  auto b = torch::randn({4, 2}, torch::requires_grad());
  auto out = model->forward(std::vector<torch::Tensor>{a, b});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(torch::allclose(out[0], a * 4));
  EXPECT_TRUE(torch::allclose(out[1], b + a + a * 2));
  (out[0].sum() + out[1].sum()).backward();
  EXPECT_TRUE(torch::allclose(a.grad(), torch::full({4, 2}, 7.0)));
  EXPECT_TRUE(torch::allclose(b.grad(), torch::ones({4, 2})));
}

TEST_F(GPipeTest, SingletonTupleStaysATuple) {
  struct OneImpl : torch::nn::Module {
    std::vector<torch::Tensor> forward(std::vector<torch::Tensor> xs) {
      return {xs.at(0) + 1};
    }
  };
  torch::nn::Sequential net(
      std::make_shared<OneImpl>(), std::make_shared<OneImpl>());
  GPipe model(net, GPipeOptions({1, 1}).chunks(2));
  auto x = torch::zeros({4, 1}, torch::requires_grad());
  auto out = model->forward(std::vector<torch::Tensor>{x});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(torch::allclose(out[0], torch::full({4, 1}, 2.0)));
  out[0].sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

// A first layer that takes a tensor and a last one that returns a tuple
// had no way through: forward(x) pointed to the tuple overload, which gave
// the first layer a std::vector (LibTorch's "Expected argument #0 to be of
// type at::Tensor", a plain c10::Error). forward_tuple runs it as
// `net->forward<std::vector<torch::Tensor>>(x)` does, and both errors say
// which call fits.
// A last layer with an optional output it leaves undefined: the plain
// model returns it undefined; GPipe threw "tensor does not have a device".
TEST_F(GPipeTest, AnUndefinedOutputStaysUndefined) {
  struct MaybeImpl : torch::nn::Module {
    std::vector<torch::Tensor> forward(torch::Tensor x) {
      return {x * 2, torch::Tensor()};
    }
  };
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(4, 4), std::make_shared<MaybeImpl>());
  net->to(torch::kDouble);
  const auto x = torch::randn({6, 4}, torch::kDouble);
  for (const auto mode :
       {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
    GPipe model(net, GPipeOptions({1, 1}).chunks(3).checkpoint(mode));
    auto out = model->forward_tuple(x);
    ASSERT_EQ(out.size(), 2u);
    EXPECT_TRUE(torch::allclose(
        out[0], net->forward<std::vector<torch::Tensor>>(x)[0]));
    EXPECT_FALSE(out[1].defined());
    EXPECT_NO_THROW(out[0].sum().backward());
  }
  // Undefined in some micro-batches only: said so.
  const auto msg = message_of([] {
    gpipe::gather({{torch::ones({1})}, {torch::Tensor()}});
  });
  EXPECT_TRUE(contains(
      msg, "tensor 0 is undefined in micro-batch 1 but defined in others"))
      << msg;
}

TEST_F(GPipeTest, ATensorInATupleOutRunsThroughForwardTuple) {
  struct SplitImpl : torch::nn::Module {
    std::vector<torch::Tensor> forward(torch::Tensor x) {
      return {x * 2, x.sin()};
    }
  };
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(6, 6), std::make_shared<SplitImpl>());
  net->to(torch::kDouble);
  GPipe model(net, GPipeOptions({1, 1}).chunks(2));
  const auto x = torch::randn({5, 6}, torch::kDouble);
  auto expected = net->forward<std::vector<torch::Tensor>>(x);
  (expected[0].sum() + expected[1].pow(2).sum()).backward();
  std::vector<torch::Tensor> grads;
  for (const auto& p : net->parameters()) {
    grads.push_back(p.grad().clone());
  }
  net->zero_grad();
  auto out = model->forward_tuple(x);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(torch::allclose(out[0], expected[0], 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(out[1], expected[1], 1e-12, 1e-12));
  (out[0].sum() + out[1].pow(2).sum()).backward();
  for (size_t k = 0; k < grads.size(); ++k) {
    EXPECT_TRUE(
        torch::allclose(net->parameters()[k].grad(), grads[k], 1e-12, 1e-12));
  }

  auto msg = message_of([&] { model->forward(x); });
  EXPECT_TRUE(contains(msg, "call forward_tuple(torch::Tensor) for them"))
      << msg;
  EXPECT_THROW(model->forward(x), c10::TypeError);
  msg = message_of([&] { model->forward(std::vector<torch::Tensor>{x}); });
  EXPECT_TRUE(contains(
      msg,
      "the first layer does not take a std::vector<torch::Tensor>, which "
      "forward(std::vector<torch::Tensor>) gives it; call "
      "forward(torch::Tensor), or forward_tuple(torch::Tensor)"))
      << msg;
  EXPECT_THROW(model->forward(std::vector<torch::Tensor>{x}), c10::TypeError);
  // And the other way: a tuple-taking first layer given one tensor (by
  // forward_tuple, which the message named as forward(torch::Tensor)).
  struct PairImpl : torch::nn::Module {
    std::vector<torch::Tensor> forward(std::vector<torch::Tensor> xs) {
      return xs;
    }
  };
  GPipe pairs(
      torch::nn::Sequential(
          std::make_shared<PairImpl>(), std::make_shared<PairImpl>()),
      GPipeOptions({1, 1}).chunks(2));
  msg = message_of([&] { pairs->forward_tuple(x); });
  EXPECT_TRUE(contains(
      msg,
      "the first layer does not take a torch::Tensor, which "
      "forward(torch::Tensor) and forward_tuple(torch::Tensor) give it; "
      "call forward(std::vector<torch::Tensor>)"))
      << msg;
}

TEST_F(GPipeTest, NonTensorOutputIsATypeError) {
  struct WordImpl : torch::nn::Module {
    std::string forward(torch::Tensor x) {
      return "hello";
    }
  };
  torch::nn::Sequential net(
      torch::nn::Identity(), std::make_shared<WordImpl>());
  GPipe model(net, GPipeOptions({1, 1}));
  auto msg = message_of([&] { model->forward(torch::ones({2, 1})); });
  EXPECT_TRUE(contains(msg, "expected partition 1 to return torch::Tensor"))
      << msg;
  EXPECT_THROW(model->forward(torch::ones({2, 1})), c10::TypeError);
}

// A last layer that reduces the batch to a 0-dim tensor: the outputs are
// joined along dimension 0, so it is refused in gpipe's words (it was
// LibTorch's "zero-dimensional tensor cannot be concatenated", or at one
// micro-batch "narrow() cannot be applied to a 0-dim tensor" in backward).
TEST_F(GPipeTest, AZeroDimOutputIsRefusedInItsOwnWords) {
  for (const int64_t chunks : {1, 2}) {
    torch::nn::Sequential net(
        torch::nn::Linear(3, 2),
        lambda([](torch::Tensor x) { return x.sum(); }));
    GPipe model(net, GPipeOptions({1, 1}).chunks(chunks));
    auto msg = message_of([&] { model->forward(torch::ones({4, 3})); });
    EXPECT_TRUE(contains(msg, "the last layer returned a 0-dim tensor")) << msg;
    EXPECT_THROW(model->forward(torch::ones({4, 3})), c10::ValueError);
  }
}

// clone() was LibTorch's "clone() has not been implemented for
// gpipe::GPipeImpl": it now copies the partitions' layers into a new
// GPipe of the same layout, chunks and checkpoint, which trains on its own.
TEST_F(GPipeTest, CloneCopiesTheLayersIntoANewPipeline) {
  for (const bool deferred : {false, true}) {
    torch::manual_seed(1);
    torch::nn::Sequential net(
        torch::nn::Linear(3, 4),
        torch::nn::BatchNorm1d(4),
        torch::nn::Tanh(),
        torch::nn::Linear(4, 2));
    net->to(torch::kFloat64);
    GPipe model(
        net, GPipeOptions({2, 2}).chunks(2).deferred_batch_norm(deferred));
    const auto x = torch::randn({6, 3}, torch::kFloat64);
    model->forward(x).sum().backward();  // running statistics move
    model->options.chunks(3).checkpoint(gpipe::Checkpoint::Never);
    auto copy = std::dynamic_pointer_cast<gpipe::GPipeImpl>(model->clone());
    ASSERT_TRUE(copy != nullptr);
    EXPECT_EQ(copy->balance(), model->balance());
    EXPECT_EQ(copy->chunks(), 3);
    EXPECT_EQ(copy->checkpoint(), gpipe::Checkpoint::Never);
    const auto mine = model->named_parameters();
    const auto theirs = copy->named_parameters();
    ASSERT_EQ(mine.size(), theirs.size());
    for (const auto& p : mine) {
      const auto& q = theirs[p.key()];
      EXPECT_TRUE(torch::equal(p.value(), q)) << p.key();
      EXPECT_FALSE(p.value().is_alias_of(q)) << p.key();
    }
    const auto buffers = model->named_buffers();
    const auto copied = copy->named_buffers();
    ASSERT_EQ(buffers.size(), copied.size());
    for (const auto& b : buffers) {
      EXPECT_TRUE(torch::equal(b.value(), copied[b.key()])) << b.key();
    }
    model->eval();
    copy->eval();
    EXPECT_TRUE(torch::equal(model->forward(x), copy->forward(x)));
    // The copy trains without touching the original.
    copy->train();
    const auto before = net->parameters()[0].clone();
    torch::optim::SGD opt(copy->parameters(), 0.5);
    copy->forward(x).sum().backward();
    opt.step();
    EXPECT_TRUE(torch::equal(net->parameters()[0], before));
    EXPECT_FALSE(torch::equal(copy->parameters()[0], before));
    EXPECT_THROW(model->clone(torch::Device(torch::kCPU)), c10::ValueError);
    // The Sequential put in eval() (as the guide says one may): the copy's
    // BatchNorm runs in eval too, so both give the same outputs.
    model->train();
    net->eval();
    auto evaluated =
        std::dynamic_pointer_cast<gpipe::GPipeImpl>(model->clone());
    EXPECT_TRUE(torch::equal(model->forward(x), evaluated->forward(x)));
    const auto stats = evaluated->named_buffers();
    for (const auto& b : model->named_buffers()) {
      EXPECT_TRUE(torch::equal(b.value(), stats[b.key()])) << b.key();
    }
    // A GPipe in eval() as a whole is copied in eval().
    model->eval();
    EXPECT_FALSE(model->clone()->is_training());
  }
}

TEST_F(GPipeTest, MovingDevicesIsRefusedButDtypeCastsWork) {
  GPipe model(two_linears(), GPipeOptions({1, 1}));
  EXPECT_THROW(model->to(torch::kCPU), c10::TypeError);
  EXPECT_THROW(model->to(torch::kCPU, torch::kDouble), c10::TypeError);
  model->to(torch::kDouble);
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kDouble);
  }
  EXPECT_EQ(
      model->forward(torch::randn({2, 3}, torch::kDouble)).scalar_type(),
      torch::kDouble);
}

TEST_F(GPipeTest, EmptySequentialPassesInputThrough) {
  GPipe model(torch::nn::Sequential(), GPipeOptions(std::vector<int64_t>{}));
  auto x = torch::randn({2, 2});
  EXPECT_TRUE(model->forward(x).is_same(x));
  auto xs = model->forward(std::vector<torch::Tensor>{x});
  ASSERT_EQ(xs.size(), 1u);
}

TEST_F(GPipeTest, NamedChildrenKeepTheirNames) {
  torch::nn::Sequential net;
  net->push_back("a", torch::nn::Linear(2, 2));
  net->push_back("b", torch::nn::Linear(2, 2));
  GPipe model(net, GPipeOptions({1, 1}));
  auto names = model->named_modules().keys();
  EXPECT_NE(
      std::find(names.begin(), names.end(), "partitions.0.a"), names.end());
  EXPECT_NE(
      std::find(names.begin(), names.end(), "partitions.1.b"), names.end());
}

TEST_F(GPipeTest, StateDictRoundTripsWithThePlainSequential) {
  auto plain = two_linears();
  GPipe model(copy_of(plain), GPipeOptions({1, 1}));
  // Plain -> GPipe: add the documented prefix.
  torch::NoGradGuard no_grad;
  auto dst = model->named_parameters();
  for (const auto& item : plain->named_parameters()) {
    const auto partition = item.key()[0] == '0' ? "0" : "1";
    dst[std::string("partitions.") + partition + "." + item.key()].copy_(
        item.value());
  }
  auto x = torch::randn({4, 3});
  EXPECT_TRUE(torch::allclose(model->forward(x), plain->forward(x)));

  // GPipe -> file -> another GPipe, and back into a plain Sequential.
  const std::string path = ::testing::TempDir() + "gpipe_state.pt";
  torch::save(model, path);
  GPipe loaded(two_linears(), GPipeOptions({1, 1}));
  torch::load(loaded, path);
  EXPECT_TRUE(torch::allclose(loaded->forward(x), plain->forward(x)));
  auto back = two_linears();
  auto src = loaded->named_parameters();
  for (auto& item : back->named_parameters()) {
    const auto partition = item.key()[0] == '0' ? "0" : "1";
    item.value().copy_(
        src[std::string("partitions.") + partition + "." + item.key()]);
  }
  EXPECT_TRUE(torch::allclose(back->forward(x), plain->forward(x)));
}

TEST_F(GPipeTest, AutogradGradThroughTheOutputIsRefused) {
  GPipe model(two_linears(), GPipeOptions({1, 1}).chunks(2));
  auto x = torch::randn({4, 3}, torch::requires_grad());
  auto y = model->forward(x);
  auto msg = message_of([&] { torch::autograd::grad({y.sum()}, {x}); });
  EXPECT_TRUE(contains(msg, "torch::autograd::grad")) << msg;
  // Over the parameters, which the output's graph reaches only through the
  // pipeline: refused the same way, also with allow_unused (not an undefined
  // gradient) and for backward(inputs=...) (not a silent no-op).
  const auto params = model->parameters();
  auto loss = model->forward(x).sum();
  msg = message_of([&] {
    torch::autograd::grad({loss}, params, {}, /*retain_graph=*/true);
  });
  EXPECT_TRUE(contains(msg, "torch::autograd::grad")) << msg;
  EXPECT_FALSE(contains(msg, "not have been used in the graph")) << msg;
  msg = message_of([&] {
    torch::autograd::grad(
        {loss},
        params,
        {},
        /*retain_graph=*/true,
        /*create_graph=*/false,
        /*allow_unused=*/true);
  });
  EXPECT_TRUE(contains(msg, "torch::autograd::grad")) << msg;
  msg = message_of([&] {
    torch::autograd::backward({loss}, {}, /*retain_graph=*/true, false, params);
  });
  EXPECT_TRUE(contains(msg, "backward(inputs=...)")) << msg;
  // The model is still usable: a plain backward fills every .grad as the
  // plain model's does.
  auto plain = two_linears();
  for (size_t k = 0; k < params.size(); ++k) {
    torch::NoGradGuard no_grad;
    plain->parameters()[k].copy_(params[k]);
  }
  auto fresh = model->forward(x.detach());
  fresh.sum().backward();
  plain->forward(x.detach()).sum().backward();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(
        torch::allclose(params[k].grad(), plain->parameters()[k].grad()))
        << k;
  }
}

// Note [Edges to the parameters]: a backward over every leaf gives each
// parameter's accumulator only the gradients of its cells, with no empty
// task from the pipeline's node; a gradient from outside the pipeline still
// reaches .grad, whether its graph was made before or after the forward.
TEST_F(GPipeTest, ABackwardRunsNoEmptyTaskForTheParameters) {
  auto net = two_linears();
  auto plain = copy_of(net);
  GPipe model(net, GPipeOptions({1, 1}).chunks(2));
  const auto params = model->parameters();
  // Counts the tasks of an accumulator that bring no gradient.
  struct CountEmpty : torch::autograd::FunctionPreHook {
    explicit CountEmpty(int* count) : count(count) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& grads) override {
      for (const auto& g : grads) {
        *count += g.defined() ? 0 : 1;
      }
      return grads;
    }
    int* count;
  };
  std::vector<int> empty(params.size(), 0);
  const auto x = torch::randn({4, 3});
  torch::Tensor previous;  // a step's loss kept alive into the next
  for (int step = 0; step < 3; ++step) {
    model->zero_grad();
    auto loss = model->forward(x).sum();
    for (const auto k : c10::irange(params.size())) {
      // Held only while the hook goes in (Note [Edges to the parameters]).
      torch::autograd::impl::try_get_grad_accumulator(params[k])->add_pre_hook(
          std::make_unique<CountEmpty>(&empty[k]));
    }
    loss.backward();
    previous = loss;
  }
  EXPECT_EQ(empty, std::vector<int>(params.size(), 0));

  // A penalty on two parameters, its graph made after the forward for one
  // and before it for the other: both gradients count.
  const auto plain_params = plain->parameters();
  auto with_penalty = [](const torch::Tensor& y,
                         const std::vector<torch::Tensor>& p,
                         const torch::Tensor& before) {
    return y.pow(2).sum() + before + p[2].pow(2).sum();
  };
  model->zero_grad();
  auto before = params[0].pow(3).sum();
  with_penalty(model->forward(x), params, before).backward();
  auto plain_before = plain_params[0].pow(3).sum();
  with_penalty(plain->forward(x), plain_params, plain_before).backward();
  for (const auto k : c10::irange(params.size())) {
    EXPECT_TRUE(torch::allclose(params[k].grad(), plain_params[k].grad())) << k;
  }

  // A retained backward keeps the edges: grad() over the parameters is
  // still refused after it, and a second backward still works.
  auto loss = model->forward(x).sum();
  loss.backward({}, /*retain_graph=*/true);
  auto msg = message_of([&] {
    torch::autograd::grad({loss}, params, {}, /*retain_graph=*/true);
  });
  EXPECT_TRUE(contains(msg, "torch::autograd::grad")) << msg;
  model->zero_grad();
  loss.backward();
  plain->zero_grad();
  plain->forward(x).sum().backward();
  for (const auto k : c10::irange(params.size())) {
    EXPECT_TRUE(torch::allclose(params[k].grad(), plain_params[k].grad())) << k;
  }
}

TEST_F(GPipeTest, SecondBackwardNeedsRetainGraph) {
  GPipe model(two_linears(), GPipeOptions({1, 1}).chunks(2));
  auto x = torch::randn({4, 3}, torch::requires_grad());
  auto loss = model->forward(x).sum();
  loss.backward({}, /*retain_graph=*/true);
  auto first = x.grad().clone();
  loss.backward();
  EXPECT_TRUE(torch::allclose(x.grad(), first * 2));
  auto msg = message_of([&] { loss.backward(); });
  EXPECT_FALSE(msg.empty());
}

TEST_F(GPipeTest, InplaceOnALeafThatRequiresGradIsReported) {
  // torchgpipe's test_inplace_on_requires_grad: the boundary input is a leaf
  // that requires grad, so an in-place ReLU on it is refused by autograd
  // where it runs with grad. Checkpointed, its forward runs without grad,
  // and the changed input is refused before the recomputation (Note
  // [In-place changes to a checkpointed input]).
  torch::nn::Sequential net(
      torch::nn::Linear(1, 1), torch::nn::ReLU(torch::nn::ReLUOptions(true)));
  GPipe never(net, GPipeOptions({1, 1}).checkpoint(Checkpoint::Never));
  auto msg = message_of([&] {
    never->forward(torch::randn({1, 1})).sum().backward();
  });
  EXPECT_TRUE(contains(msg, "leaf Variable that requires grad")) << msg;
  GPipe always(net, GPipeOptions({1, 1}).checkpoint(Checkpoint::Always));
  msg = message_of([&] {
    always->forward(torch::randn({1, 1})).sum().backward();
  });
  EXPECT_TRUE(contains(msg, "input was changed in place")) << msg;
}

}  // namespace
