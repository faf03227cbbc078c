// Skip connections: the API, the static check, the layout, the trackers, and
// skips through GPipe (gradients, memory, errors). Ports torchgpipe's
// tests/skip/*.

#include "skip.h"

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <thread>

#include "common.h"

namespace gpipe {
namespace {

using testing::SeededTest;

// Declares what it is told and stashes/pops nothing: for the static checks.
struct DeclareImpl : torch::nn::Module, Skippable {
  DeclareImpl(std::vector<std::string> stash, std::vector<std::string> pop)
      : Skippable(std::move(stash), std::move(pop)) {}
  torch::Tensor forward(torch::Tensor x) {
    return x;
  }
};
TORCH_MODULE(Declare);

// Stashes `scale * x` (a tensor of its own, so that its life can be
// watched) and passes x on.
// Cloneable, as a Skippable layer may be: copies keep their declarations
// and namespaces.
struct StashImpl : torch::nn::Cloneable<StashImpl>, Skippable {
  explicit StashImpl(std::string name = "skip", double scale = 2.0)
      : Skippable({name}, {}), name(std::move(name)), scale(scale) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    auto s = x * scale;
    stashed = s.storage().getWeakStorageImpl();
    stash(name, s);
    return x;
  }
  std::string name;
  double scale;
  c10::weak_intrusive_ptr<c10::StorageImpl> stashed{
      c10::intrusive_ptr<c10::StorageImpl>()};
};
TORCH_MODULE(Stash);

// Pops and adds what it popped, if anything.
struct PopMaybeAddImpl : torch::nn::Cloneable<PopMaybeAddImpl>, Skippable {
  explicit PopMaybeAddImpl(std::string name = "skip")
      : Skippable({}, {name}), name(std::move(name)) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    auto s = pop(name);
    return s.defined() ? x + s : x;
  }
  std::string name;
};
TORCH_MODULE(PopMaybeAdd);

// Stashes an undefined tensor.
struct StashNothingImpl : torch::nn::Module, Skippable {
  StashNothingImpl() : Skippable({"skip"}, {}) {}
  torch::Tensor forward(torch::Tensor x) {
    stash("skip", torch::Tensor());
    return x;
  }
};
TORCH_MODULE(StashNothing);

// Stashes only when armed: a declared name left unused otherwise.
struct MaybeStashImpl : torch::nn::Module, Skippable {
  MaybeStashImpl() : Skippable({"skip"}, {}) {}
  torch::Tensor forward(torch::Tensor x) {
    if (armed) {
      stash("skip", x);
    }
    return x;
  }
  bool armed = true;
};
TORCH_MODULE(MaybeStash);

// Calls stash/pop with whatever name it is told, declared or not.
struct MisuseImpl : torch::nn::Module, Skippable {
  MisuseImpl(std::vector<std::string> stash, std::vector<std::string> pop)
      : Skippable(std::move(stash), std::move(pop)) {}
  torch::Tensor forward(torch::Tensor x) {
    if (!stash_name.empty()) {
      stash(stash_name, x);
    }
    if (!pop_name.empty()) {
      return pop(pop_name);
    }
    return x;
  }
  std::string stash_name;
  std::string pop_name;
};
TORCH_MODULE(Misuse);

// Checks that `text` contains `part`, printing both when it does not.
#define EXPECT_CONTAINS(text, part)                                        \
  do {                                                                     \
    const std::string text_ = (text);                                      \
    EXPECT_NE(text_.find(part), std::string::npos)                         \
        << "expected to find \"" << (part) << "\" in \"" << text_ << "\""; \
  } while (false)

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

// --- api (tests/skip/test_api.py) ---

TEST(SkipApiTest, NamespacesDiffer) {
  Namespace a;
  Namespace b;
  EXPECT_NE(a, b);
  EXPECT_NE(a, Namespace::global());
  EXPECT_TRUE(a < b || b < a);
}

TEST(SkipApiTest, NamespaceCopiesAreEqual) {
  Namespace a;
  Namespace copy = a;
  EXPECT_EQ(a, copy);
}

// A name twice in one list, or an empty name, was taken by the layer and
// refused only when a GPipe verified the model (or never, outside one).
TEST(SkipApiTest, ANameTwiceOrEmptyIsRefusedWhenTheLayerIsMade) {
  using Names = std::vector<std::string>;
  EXPECT_CONTAINS(
      message_of([] {
        Declare(Names{"a", "a"}, Names{});
      }),
      ("expects each stash name once, but got 'a' twice in 'a', 'a'"));
  EXPECT_CONTAINS(
      message_of([] {
        Declare(Names{}, Names{"b", "c", "b"});
      }),
      ("expects each pop name once, but got 'b' twice"));
  EXPECT_CONTAINS(
      message_of([] { Declare(Names{""}, Names{}); }),
      ("expects non-empty skip names"));
  EXPECT_THROW(Declare(Names{"a", "a"}, Names{}), c10::ValueError);
  EXPECT_NO_THROW(Declare(Names{"a"}, Names{"a"}));  // stash and pop one
}

TEST(SkipApiTest, IsolateMapsAllOrOnlySomeNames) {
  Namespace ns1;
  Namespace ns2;
  auto layer = std::make_shared<DeclareImpl>(
      std::vector<std::string>{"alice", "bob"}, std::vector<std::string>{});
  EXPECT_EQ(layer->key("alice").ns, Namespace::global());
  layer->isolate(ns1, {"alice"}).isolate(ns2, {"bob"});
  EXPECT_EQ(layer->key("alice").ns, ns1);
  EXPECT_EQ(layer->key("bob").ns, ns2);
  layer->isolate(ns2);
  EXPECT_EQ(layer->key("alice").ns, ns2);
  EXPECT_THROW(layer->isolate(ns1, {"carol"}), c10::ValueError);
}

// --- stash/pop (tests/skip/test_stash_pop.py) ---

class SkipStashPopTest : public SeededTest {};

TEST_F(SkipStashPopTest, StashGoesToTheThreadsTracker) {
  detail::PlainSkipTracker tracker;
  detail::SkipTrackerGuard guard(&tracker);
  Stash layer;
  layer(torch::ones({2}));
  EXPECT_EQ(tracker.size(), 1u);
}

TEST_F(SkipStashPopTest, PopReturnsWhatWasStashed) {
  detail::PlainSkipTracker tracker;
  detail::SkipTrackerGuard guard(&tracker);
  Stash stash_layer("skip", 1.0);
  PopMaybeAdd pop_layer;
  auto y = pop_layer(stash_layer(torch::full({1}, 21.0)));
  EXPECT_EQ(y.item<double>(), 42.0);
  EXPECT_EQ(tracker.size(), 0u);
}

TEST_F(SkipStashPopTest, StashNotDeclared) {
  Misuse layer(std::vector<std::string>{"foo"}, std::vector<std::string>{});
  layer->stash_name = "bar";
  EXPECT_CONTAINS(
      message_of([&] { layer(torch::ones({1})); }),
      ("'bar' has not been declared as stashable"));
}

TEST_F(SkipStashPopTest, PopNotDeclared) {
  Misuse layer(std::vector<std::string>{}, std::vector<std::string>{"foo"});
  layer->pop_name = "bar";
  EXPECT_CONTAINS(
      message_of([&] { layer(torch::ones({1})); }),
      ("'bar' has not been declared as poppable"));
}

TEST_F(SkipStashPopTest, PopNotStashed) {
  detail::PlainSkipTracker tracker;
  detail::SkipTrackerGuard guard(&tracker);
  PopMaybeAdd layer;
  EXPECT_CONTAINS(
      message_of([&] { layer(torch::ones({1})); }),
      ("'skip' has not been stashed"));
}

TEST_F(SkipStashPopTest, StashUndefined) {
  detail::PlainSkipTracker tracker;
  detail::SkipTrackerGuard guard(&tracker);
  StashNothing stash_layer;
  PopMaybeAdd pop_layer;
  auto y = pop_layer(stash_layer(torch::ones({1})));
  EXPECT_EQ(y.item<float>(), 1.0f);
}

TEST_F(SkipStashPopTest, DeclaredButNotUsedIsAnErrorInGPipe) {
  MaybeStash stash_layer;
  stash_layer->armed = false;
  torch::nn::Sequential net(stash_layer, PopMaybeAdd());
  GPipe model(net, GPipeOptions({1, 1}).chunks(2));
  EXPECT_CONTAINS(
      message_of([&] {
        model->forward(torch::ones({2, 1}));
      }),
      ("'skip' must be stashed but have not"));
  // The model works again once the layer behaves.
  stash_layer->armed = true;
  auto y = model->forward(torch::ones({2, 1}));
  EXPECT_TRUE(torch::equal(y, torch::full({2, 1}, 2.0f)));
}

TEST_F(SkipStashPopTest, PlainSequentialRunsSkippableLayers) {
  torch::nn::Sequential net(
      Stash("skip", 3.0), torch::nn::Identity(), PopMaybeAdd());
  auto y = net->forward(torch::ones({2}));
  EXPECT_TRUE(torch::equal(y, torch::full({2}, 4.0f)));
}

// A forward outside GPipe that throws between a stash and its pop leaves
// the tensor in the thread's table, where the next pop of that name (in
// another model too) would take it: clear_stashed_skips() drops it, and the
// pop is refused again. (Inside GPipe a failed step leaves nothing.)
TEST_F(SkipStashPopTest, ClearStashedSkipsDropsWhatAFailedForwardLeft) {
  torch::nn::Sequential failing(
      Stash("skip", 3.0),
      torch::nn::Functional([](torch::Tensor x) -> torch::Tensor {
        TORCH_CHECK(false, "bad input");
        return x;
      }),
      PopMaybeAdd());
  EXPECT_THROW(failing->forward(torch::ones({2})), c10::Error);
  EXPECT_EQ(clear_stashed_skips(), 1);
  EXPECT_EQ(clear_stashed_skips(), 0);
  PopMaybeAdd other;
  EXPECT_CONTAINS(
      message_of([&] { other(torch::ones({1})); }),
      ("'skip' has not been stashed"));
  // Inside GPipe the same failure leaves nothing in the caller's table.
  GPipe model(failing, GPipeOptions({2, 1}).chunks(2));
  EXPECT_THROW(model->forward(torch::ones({2, 1})), c10::Error);
  EXPECT_EQ(clear_stashed_skips(), 0);
}

// --- trackers (tests/skip/test_tracker.py) ---

TEST(SkipTrackerTest, EachThreadHasItsOwnDefaultTracker) {
  Stash stash_layer;
  stash_layer(torch::ones({1}));
  std::string error;
  std::thread other([&] {
    PopMaybeAdd pop_layer;
    error = message_of([&] { pop_layer(torch::ones({1})); });
  });
  other.join();
  EXPECT_CONTAINS(error, ("has not been stashed"));
  // This thread's table still holds it.
  PopMaybeAdd pop_layer;
  EXPECT_EQ(pop_layer(torch::ones({1})).item<float>(), 3.0f);
}

// --- verify_skippables (tests/skip/test_verify_skippables.py) ---

torch::nn::Sequential declared(
    std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>>
        layers) {
  torch::nn::Sequential net;
  for (auto& [stash, pop] : layers) {
    net->push_back(Declare(stash, pop));
  }
  return net;
}

std::string verify_message(const torch::nn::Sequential& net) {
  try {
    verify_skippables(net);
  } catch (const c10::TypeError& e) {
    return e.what();
  }
  return "";
}

TEST(VerifySkippablesTest, Matching) {
  EXPECT_NO_THROW(verify_skippables(declared({{{"foo"}, {}}, {{}, {"foo"}}})));
}

TEST(VerifySkippablesTest, StashNotPopped) {
  EXPECT_CONTAINS(
      verify_message(declared({{{"foo"}, {}}})),
      ("no module declared 'foo' as poppable but stashed (declared stashable "
       "by '0')"));
  // The stashing layer is named, as the pop without a stash names its own.
  EXPECT_CONTAINS(
      verify_message(declared({{{}, {}}, {{"foo"}, {}}})),
      ("no module declared 'foo' as poppable but stashed (declared stashable "
       "by '1')"));
}

TEST(VerifySkippablesTest, PopUnknown) {
  EXPECT_CONTAINS(
      verify_message(declared({{{}, {"foo"}}})),
      ("'0' declared 'foo' as poppable but it was not stashed"));
}

TEST(VerifySkippablesTest, StashAgain) {
  EXPECT_CONTAINS(
      verify_message(declared({{{"foo"}, {}}, {{"foo"}, {}}, {{}, {"foo"}}})),
      ("'1' redeclared 'foo' as stashable"));
}

TEST(VerifySkippablesTest, PopAgain) {
  EXPECT_CONTAINS(
      verify_message(declared({{{"foo"}, {}}, {{}, {"foo"}}, {{}, {"foo"}}})),
      ("'2' redeclared 'foo' as poppable"));
}

TEST(VerifySkippablesTest, StashAndPopTogetherWithDifferentNames) {
  EXPECT_NO_THROW(verify_skippables(
      declared({{{"foo"}, {}}, {{"bar"}, {"foo"}}, {{}, {"bar"}}})));
}

TEST(VerifySkippablesTest, StashAndPopTogetherWithTheSameName) {
  const auto message = verify_message(
      declared({{{"foo"}, {}}, {{"foo"}, {"foo"}}, {{}, {"foo"}}}));
  EXPECT_CONTAINS(
      message, ("'1' declared 'foo' both as stashable and as poppable"));
}

TEST(VerifySkippablesTest, DoubleStashPopListsEveryProblem) {
  const auto message = verify_message(
      declared({{{"foo"}, {}}, {{}, {"foo"}}, {{"foo"}, {}}, {{}, {"foo"}}}));
  EXPECT_CONTAINS(message, ("one or more pairs"));
  EXPECT_CONTAINS(message, ("'2' redeclared 'foo' as stashable"));
  EXPECT_CONTAINS(message, ("'3' redeclared 'foo' as poppable"));
}

TEST(VerifySkippablesTest, DoubleStashPopIsolatedByNamespaces) {
  Namespace ns1;
  Namespace ns2;
  torch::nn::Sequential net;
  for (const auto& ns : {ns1, ns2}) {
    Declare stash(std::vector<std::string>{"foo"}, std::vector<std::string>{});
    stash->isolate(ns);
    Declare pop(std::vector<std::string>{}, std::vector<std::string>{"foo"});
    pop->isolate(ns);
    net->push_back(stash);
    net->push_back(pop);
  }
  EXPECT_NO_THROW(verify_skippables(net));
}

TEST(VerifySkippablesTest, GPipeRefusesUnmatchedSkips) {
  EXPECT_THROW(
      GPipe(declared({{{"foo"}, {}}, {{}, {}}}), GPipeOptions({1, 1})),
      c10::TypeError);
}

// --- layout (tests/skip/test_inspect_skip_layout.py) ---

std::vector<torch::nn::Sequential> partitions_of(
    std::vector<std::vector<torch::nn::AnyModule>> layers) {
  std::vector<torch::nn::Sequential> parts;
  for (auto& part : layers) {
    torch::nn::Sequential seq;
    for (auto& layer : part) {
      seq->push_back(layer);
    }
    parts.push_back(seq);
  }
  return parts;
}

using Policy = std::vector<std::pair<int64_t, SkipKey>>;

TEST(SkipLayoutTest, NoSkippables) {
  detail::SkipLayout layout(partitions_of(
      {{torch::nn::AnyModule(torch::nn::Identity())},
       {torch::nn::AnyModule(torch::nn::Identity())}}));
  EXPECT_TRUE(layout.copy_policy(0).empty());
  EXPECT_TRUE(layout.copy_policy(1).empty());
  EXPECT_FALSE(layout.any_copy());
}

TEST(SkipLayoutTest, InnerPartitionNeedsNoCopy) {
  detail::SkipLayout layout(partitions_of(
      {{torch::nn::AnyModule(Stash("foo")),
        torch::nn::AnyModule(PopMaybeAdd("foo"))},
       {torch::nn::AnyModule(torch::nn::Identity())}}));
  EXPECT_TRUE(layout.copy_policy(0).empty());
  EXPECT_TRUE(layout.copy_policy(1).empty());
  EXPECT_FALSE(layout.requires_copy(SkipKey{Namespace::global(), "foo"}));
}

TEST(SkipLayoutTest, AdjoiningPartitions) {
  detail::SkipLayout layout(partitions_of(
      {{torch::nn::AnyModule(Stash("foo"))},
       {torch::nn::AnyModule(PopMaybeAdd("foo"))}}));
  const SkipKey foo{Namespace::global(), "foo"};
  EXPECT_TRUE(layout.copy_policy(0).empty());
  EXPECT_EQ(layout.copy_policy(1), (Policy{{0, foo}}));
  EXPECT_TRUE(layout.requires_copy(foo));
  EXPECT_EQ(layout.routed_out(0).count(foo), 1u);
}

TEST(SkipLayoutTest, FarPartitions) {
  detail::SkipLayout layout(partitions_of(
      {{torch::nn::AnyModule(Stash("foo"))},
       {torch::nn::AnyModule(torch::nn::Identity())},
       {torch::nn::AnyModule(PopMaybeAdd("foo"))}}));
  const SkipKey foo{Namespace::global(), "foo"};
  EXPECT_TRUE(layout.copy_policy(1).empty());
  EXPECT_EQ(layout.copy_policy(2), (Policy{{0, foo}}));
  EXPECT_EQ(layout.route(foo), (std::pair<int64_t, int64_t>{0, 2}));
}

TEST(SkipLayoutTest, TwoPopsFromDifferentPartitionsSortedBySource) {
  detail::SkipLayout layout(partitions_of(
      {{torch::nn::AnyModule(Stash("foo"))},
       {torch::nn::AnyModule(Stash("bar"))},
       {torch::nn::AnyModule(PopMaybeAdd("bar")),
        torch::nn::AnyModule(PopMaybeAdd("foo"))}}));
  const SkipKey foo{Namespace::global(), "foo"};
  const SkipKey bar{Namespace::global(), "bar"};
  EXPECT_EQ(layout.copy_policy(2), (Policy{{0, foo}, {1, bar}}));
}

TEST(SkipLayoutTest, Namespaces) {
  Namespace ns1;
  Namespace ns2;
  Stash s1("foo");
  s1->isolate(ns1);
  Stash s2("foo");
  s2->isolate(ns2);
  PopMaybeAdd p2("foo");
  p2->isolate(ns2);
  PopMaybeAdd p1("foo");
  p1->isolate(ns1);
  detail::SkipLayout layout(partitions_of(
      {{torch::nn::AnyModule(s1)},
       {torch::nn::AnyModule(s2)},
       {torch::nn::AnyModule(p2), torch::nn::AnyModule(p1)}}));
  EXPECT_EQ(
      layout.copy_policy(2),
      (Policy{{0, SkipKey{ns1, "foo"}}, {1, SkipKey{ns2, "foo"}}}));
}

// --- through GPipe (tests/skip/test_gpipe.py, test_leak.py) ---

// Linear layers with one skip from layer 1 to layer 7:
// 0 Linear, 1 Stash, 2 Linear, 3 Tanh, 4 Linear, 5 Tanh, 6 Linear, 7
// PopMaybeAdd, 8 Linear.
torch::nn::Sequential skip_model() {
  return torch::nn::Sequential(
      torch::nn::Linear(4, 4),
      Stash("skip", 0.5),
      torch::nn::Linear(4, 4),
      torch::nn::Tanh(),
      torch::nn::Linear(4, 4),
      torch::nn::Tanh(),
      torch::nn::Dropout(0.3),
      PopMaybeAdd("skip"),
      torch::nn::Linear(4, 3));
}

struct SkipCase {
  std::vector<int64_t> balance;
  int64_t boundaries;  // partition boundaries the skip crosses
};

class SkipGPipeTest : public SeededTest,
                      public ::testing::WithParamInterface<
                          std::tuple<SkipCase, Checkpoint, int64_t>> {};

TEST_P(SkipGPipeTest, GradientsEqualThePlainModel) {
  const auto& [c, mode, chunks] = GetParam();
  auto net = skip_model();
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  auto x = torch::randn({6, 4}, torch::kFloat64).requires_grad_(true);
  auto x2 = x.detach().clone().requires_grad_(true);

  // Dropout draws per micro-batch: compare in eval mode for the values, and
  // in training mode for a model without randomness in the skip's path.
  for (bool training : {false, true}) {
    net->zero_grad();
    copy->zero_grad();
    x.mutable_grad().reset();
    x2.mutable_grad().reset();
    GPipe model(copy, GPipeOptions(c.balance).chunks(chunks).checkpoint(mode));
    if (training) {
      net->train();
      model->train();
      // Dropout(p=0.3) in train mode: use p=0 to stay deterministic.
      for (auto* m : {&net, &copy}) {
        (*m)[6]->as<torch::nn::Dropout>()->options.p(0.0);
      }
    } else {
      net->eval();
      model->eval();
    }
    auto expected = net->forward(x);
    auto got = model->forward(x2);
    ASSERT_TRUE(torch::allclose(got, expected, 1e-10, 1e-12));
    (expected * expected).sum().backward();
    (got * got).sum().backward();
    ASSERT_TRUE(torch::allclose(x2.grad(), x.grad(), 1e-10, 1e-12));
    auto g1 = testing::grads_of(*net);
    auto g2 = testing::grads_of(*copy);
    ASSERT_EQ(g1.size(), g2.size());
    for (size_t k = 0; k < g1.size(); ++k) {
      ASSERT_TRUE(torch::allclose(g2[k], g1[k], 1e-10, 1e-12))
          << "parameter " << k << " (" << c.boundaries << " boundaries)";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Crossings,
    SkipGPipeTest,
    ::testing::Combine(
        ::testing::Values(
            SkipCase{{9}, 0},
            SkipCase{{1, 8}, 0},
            SkipCase{{4, 5}, 1},
            SkipCase{{2, 3, 4}, 2}),
        ::testing::Values(
            Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never),
        ::testing::Values(int64_t{1}, int64_t{3})));

TEST_F(SkipGPipeTest, UndefinedSkipCreatesNoRoute) {
  auto net = torch::nn::Sequential(
      StashNothing(), torch::nn::Identity(), PopMaybeAdd());
  GPipe model(net, GPipeOptions({1, 2}).chunks(2));
  auto x = torch::ones({4, 1}, torch::requires_grad());
  auto y = model->forward(x);
  EXPECT_TRUE(torch::equal(y, x));
  y.mean().backward();
  EXPECT_NEAR(x.grad().mean().item<double>(), 0.25, 1e-7);
}

TEST_F(SkipGPipeTest, SkipOfNonDifferentiableTensor) {
  // An integer skip crosses partitions; it carries no gradient.
  struct CountImpl : torch::nn::Module, Skippable {
    CountImpl() : Skippable({"n"}, {}) {}
    torch::Tensor forward(torch::Tensor x) {
      stash("n", torch::ones({x.size(0), 1}, torch::kLong));
      return x;
    }
  };
  struct UseImpl : torch::nn::Module, Skippable {
    UseImpl() : Skippable({}, {"n"}) {}
    torch::Tensor forward(torch::Tensor x) {
      return x * pop("n").to(x.scalar_type());
    }
  };
  torch::nn::Sequential net(
      std::make_shared<CountImpl>(),
      torch::nn::Linear(2, 2),
      std::make_shared<UseImpl>());
  GPipe model(
      net, GPipeOptions({2, 1}).chunks(2).checkpoint(Checkpoint::Always));
  auto x = torch::randn({4, 2}, torch::requires_grad());
  model->forward(x).sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST_F(SkipGPipeTest, RetainGraphWithSkips) {
  auto net = skip_model();
  (*net)[6]->as<torch::nn::Dropout>()->options.p(0.0);
  GPipe model(
      net,
      GPipeOptions({2, 3, 4}).chunks(2).checkpoint(Checkpoint::ExceptLast));
  auto x = torch::randn({4, 4}, torch::requires_grad());
  auto y = model->forward(x).sum();
  y.backward({}, /*retain_graph=*/true);
  auto once = x.grad().clone();
  y.backward();
  EXPECT_TRUE(torch::allclose(x.grad(), 2 * once));
}

// Needs a CUDA device: skipped on CPU-only machines (CI), run on a GPU host.
TEST_F(SkipGPipeTest, SkipFromCpuToCudaPartition_CUDA) {
  if (!torch::cuda::is_available()) {
    // Skipped: needs a CUDA device (CPU-only machines and CI)
    GTEST_SKIP() << "needs a CUDA device";  // CPU-only machines and CI
  }
  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    auto net = skip_model();
    (*net)[6]->as<torch::nn::Dropout>()->options.p(0.0);
    net->to(torch::kFloat64);
    auto copy = testing::copy_of(net);
    // The skip goes from partition 0 on the CPU straight to partition 2 on
    // the GPU, and its gradient back.
    GPipe model(
        copy,
        GPipeOptions({2, 3, 4})
            .devices(
                {torch::kCPU, torch::Device("cuda:0"), torch::Device("cuda:0")})
            .chunks(3)
            .checkpoint(mode));
    auto x = torch::randn({7, 4}, torch::kFloat64).requires_grad_(true);
    auto x2 = x.detach().clone().requires_grad_(true);
    auto expected = net->forward(x);
    auto got = model->forward(x2);
    ASSERT_TRUE(got.is_cuda());
    ASSERT_TRUE(torch::allclose(got.cpu(), expected, 1e-10, 1e-12));
    expected.pow(2).sum().backward();
    got.pow(2).sum().backward();
    ASSERT_TRUE(torch::allclose(x2.grad(), x.grad(), 1e-10, 1e-12));
    auto g1 = testing::grads_of(*net);
    auto g2 = testing::grads_of(*copy);
    for (size_t k = 0; k < g1.size(); ++k) {
      ASSERT_TRUE(torch::allclose(g2[k].cpu(), g1[k], 1e-10, 1e-12))
          << "parameter " << k;
    }
  }
}

// A stashed tensor is freed once its last use is done.
class SkipLeakTest
    : public SeededTest,
      public ::testing::WithParamInterface<std::tuple<bool, Checkpoint>> {};

TEST_P(SkipLeakTest, StashedTensorIsFreedAfterItsLastUse) {
  const auto& [training, mode] = GetParam();
  Stash stash_layer("skip", 2.0);
  // Records how many owners the popped tensor's storage has besides itself.
  struct WatchImpl : torch::nn::Module, Skippable {
    WatchImpl() : Skippable({}, {"skip"}) {}
    torch::Tensor forward(torch::Tensor x) {
      auto s = pop("skip");
      owners.push_back(static_cast<int64_t>(s.storage().use_count()));
      return x + s;
    }
    std::vector<int64_t> owners;
  };
  auto watch = std::make_shared<WatchImpl>();
  torch::nn::Sequential net(
      torch::nn::Linear(3, 3), stash_layer, torch::nn::Linear(3, 3), watch);
  GPipe model(net, GPipeOptions({2, 2}).chunks(2).checkpoint(mode));
  training ? model->train() : model->eval();
  auto x = torch::randn({4, 3});

  {
    // Without a graph nothing keeps the skip once it is popped.
    torch::NoGradGuard no_grad;
    model->forward(x);
    EXPECT_TRUE(stash_layer->stashed.expired());
    for (auto owners : watch->owners) {
      EXPECT_EQ(owners, 1);  // only the popped tensor itself
    }
  }
  auto y = model->forward(x);
  y.sum().backward();
  // After backward nothing is left of any micro-batch's skip.
  EXPECT_TRUE(stash_layer->stashed.expired());
  y = torch::Tensor();
  EXPECT_TRUE(stash_layer->stashed.expired());
}

INSTANTIATE_TEST_SUITE_P(
    Modes,
    SkipLeakTest,
    ::testing::Combine(
        ::testing::Bool(),
        ::testing::Values(
            Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never)));

TEST_F(SkipGPipeTest, SkipAcrossPartitionsIsNotPassedThroughTheMiddle) {
  // The middle partition sees only its boundary input: a layer there
  // records the tensors it is given.
  auto seen = std::make_shared<std::vector<int64_t>>();
  auto middle = testing::lambda([seen](torch::Tensor x) {
    seen->push_back(x.size(1));
    return x;
  });
  torch::nn::Sequential net(Stash("skip", 1.0), middle, PopMaybeAdd());
  GPipe model(net, GPipeOptions({1, 1, 1}).chunks(2));
  auto y = model->forward(torch::ones({2, 5}));
  EXPECT_TRUE(torch::equal(y, torch::full({2, 5}, 2.0f)));
  EXPECT_EQ(*seen, (std::vector<int64_t>{5, 5}));
}

}  // namespace
}  // namespace gpipe
