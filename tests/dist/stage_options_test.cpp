// GPipe and PipelineStage check their model and options with one function:
// the same mistake gets the same error from both (naming which of the two
// refused it), before anything is built.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "dist/ranks.h"
#include "random.h"

namespace gpipe {
namespace {

using dist::World;
using dist::testing::run_ranks;

// The message of what `make` throws, with the first mention of the class
// that refused it replaced by "<who>"; fails the test when nothing is thrown or
// the type is not c10::ValueError.
std::string refusal(const std::function<void()>& make, const std::string& who) {
  try {
    make();
  } catch (const c10::ValueError& e) {
    std::string message = e.what_without_backtrace();
    const auto at = message.find(who);
    if (at != std::string::npos) {
      message.replace(at, who.size(), "<who>");
    }
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << who << " threw another type: " << e.what();
    return {};
  }
  ADD_FAILURE() << who << " accepted what it should refuse";
  return {};
}

// A layer holding a GPipe (a GPipe's forward is overloaded, so it cannot
// be a Sequential's layer itself).
struct WrapperImpl : torch::nn::Module {
  explicit WrapperImpl(GPipe inner)
      : inner(register_module("inner", std::move(inner))) {}
  torch::Tensor forward(torch::Tensor x) {
    return inner->forward(x);
  }
  GPipe inner;
};
TORCH_MODULE(Wrapper);

struct BadCase {
  std::string what;
  std::function<torch::nn::Sequential()> net;
  std::function<GPipeOptions()> options;
};

TEST(StageOptionsTest, GPipeAndPipelineStageRefuseTheSameMistakesAlike) {
  auto two_layers = [] {
    return torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::Tanh());
  };
  std::vector<BadCase> cases{
      {"negative threads_per_lane",
       two_layers,
       [] { return GPipeOptions({2}).threads_per_lane(-1); }},
      {"stages_per_lane 0",
       two_layers,
       [] { return GPipeOptions({2}).stages_per_lane(0); }},
      {"stages_per_lane that does not divide",
       two_layers,
       [] {
         return GPipeOptions({1, 1}).stages_per_lane(3);
       }},
      {"no chunks", two_layers, [] { return GPipeOptions({2}).chunks(0); }},
      {"a balance that misses a layer",
       two_layers,
       [] { return GPipeOptions({1}); }},
      {"a nested GPipe",
       [] {
         torch::nn::Sequential inner(torch::nn::Linear(3, 3));
         return torch::nn::Sequential(
             Wrapper(GPipe(inner, GPipeOptions({1}).devices({torch::kCPU}))),
             torch::nn::Tanh());
       },
       [] { return GPipeOptions({2}); }},
      {"a layer used twice",
       [] {
         torch::nn::Linear shared(3, 3);
         return torch::nn::Sequential(shared, shared);
       },
       [] { return GPipeOptions({2}); }},
  };
  run_ranks(1, [&](World world) {
    for (const auto& c : cases) {
      SCOPED_TRACE(c.what);
      const auto local = refusal(
          [&] { GPipe(c.net(), c.options().devices({torch::kCPU})); },
          "gpipe::GPipe");
      const auto stage = refusal(
          [&] { dist::PipelineStage(c.net(), c.options(), world); },
          "gpipe::dist::PipelineStage");
      EXPECT_FALSE(local.empty());
      EXPECT_EQ(local, stage);
    }
  });
}

// A layout changed in one rank's public options after construction is
// refused on every rank at the next pass (train_step, then forward), naming
// the change, rather than running partitions the options do not describe.
TEST(StageOptionsTest, ALayoutChangedInOptionsIsRefusedOnEveryRank) {
  for (const bool train : {true, false}) {
    SCOPED_TRACE(train ? "train_step" : "forward");
    std::vector<std::string> messages(2);
    run_ranks(2, [&](World world) {
      torch::nn::Sequential net(
          torch::nn::Linear(3, 3), torch::nn::Tanh(), torch::nn::Linear(3, 3));
      dist::PipelineStage stage(net, GPipeOptions({2, 1}).chunks(2), world);
      if (world.rank() == 1) {
        stage->options.balance({1, 2});
      }
      EXPECT_EQ(stage->balance(), (std::vector<int64_t>{2, 1}));
      const auto x = torch::randn({4, 3});
      try {
        if (train) {
          stage->train_step(x, x, [](torch::Tensor out, torch::Tensor y) {
            return torch::mse_loss(out, y);
          });
        } else {
          stage->forward(x);
        }
        ADD_FAILURE() << "rank " << world.rank() << " ran the pass";
      } catch (const c10::Error& e) {
        messages[world.rank()] = e.what_without_backtrace();
      }
    });
    for (const auto& m : messages) {
      EXPECT_NE(
          m.find("gpipe::dist::PipelineStage was built with options.balance() "
                 "[2, 1], but it is now [1, 2]"),
          std::string::npos)
          << m;
    }
  }
}

// A schedule whose plan does not fit the stage's placement (ZB-V needs a V,
// the stage has one partition per rank) is refused on every rank before
// the pass begins, and the stage stays usable; it used to fail the World
// on every rank, which then refused every later pass.
TEST(
    StageOptionsTest, AScheduleThatDoesNotFitThePlacementLeavesTheStageUsable) {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](World world) {
    torch::manual_seed(1);
    torch::nn::Sequential net(
        torch::nn::Linear(3, 3), torch::nn::Tanh(), torch::nn::Linear(3, 3));
    dist::PipelineStage stage(net, GPipeOptions({2, 1}).chunks(2), world);
    const auto x = torch::randn({4, 3});
    const auto mse = [](torch::Tensor out, torch::Tensor y) {
      return torch::mse_loss(out, y);
    };
    const auto y = world.rank() == 1 ? x : torch::Tensor();
    try {
      stage->train_step(x, y, mse, Schedule::ZeroBubbleV);
      ADD_FAILURE() << "rank " << world.rank() << " ran the pass";
    } catch (const c10::ValueError& e) {
      messages[world.rank()] = e.what_without_backtrace();
    }
    const auto loss = stage->train_step(x, y, mse, Schedule::OneFOneB);
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
  });
  for (const auto& m : messages) {
    EXPECT_NE(
        m.find("zero_bubble_v runs on Placement::v_shape"), std::string::npos)
        << m;
  }
  EXPECT_NE(
      messages[1].find("rank 0 refused the pass before it began"),
      std::string::npos)
      << messages[1];
}

// A pass draws one step seed from every process's default generator, as a
// GPipe's does, so that ranks seeded alike stay alike (their shuffles of
// the data agree); a pass rank 0 refused draws none. The ranks other than
// 0 drew theirs before they heard of the refusal, and left their
// generators one draw ahead of rank 0's. Here the ranks are threads and
// share one generator: after two refused passes it is where it was, and
// after a pass that ran it moved by one draw per rank.
TEST(StageOptionsTest, ARefusedPassDrawsFromNoRanksGenerator) {
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(1);
    nets.emplace_back(
        torch::nn::Linear(3, 3), torch::nn::Tanh(), torch::nn::Linear(3, 3));
  }
  const auto x = torch::randn({4, 3});
  const auto mse = [](torch::Tensor out, torch::Tensor y) {
    return torch::mse_loss(out, y);
  };
  std::vector<int> refused(2, 0);
  torch::manual_seed(7);
  run_ranks(2, [&](World world) {
    const auto r = world.rank();
    dist::PipelineStage stage(nets[r], GPipeOptions({2, 1}).chunks(2), world);
    const auto y = r == 1 ? x : torch::Tensor();
    try {
      stage->train_step(torch::Tensor(), y, mse, Schedule::OneFOneB);
    } catch (const c10::Error&) {
      ++refused[r];
    }
    try {
      stage->forward(r == 0 ? x.narrow(0, 0, 0) : torch::Tensor());
    } catch (const c10::Error&) {
      ++refused[r];
    }
  });
  EXPECT_EQ(refused, (std::vector<int>{2, 2}));
  const auto after_refusals = torch::rand({4});
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(after_refusals, torch::rand({4})));

  torch::manual_seed(7);
  run_ranks(2, [&](World world) {
    const auto r = world.rank();
    dist::PipelineStage stage(nets[r], GPipeOptions({2, 1}).chunks(2), world);
    stage->train_step(
        r == 0 ? x : torch::Tensor(),
        r == 1 ? x : torch::Tensor(),
        mse,
        Schedule::OneFOneB);
  });
  const auto after_a_step = torch::rand({4});
  torch::manual_seed(7);
  gpipe::detail::draw_step_seed();
  gpipe::detail::draw_step_seed();
  EXPECT_TRUE(torch::equal(after_a_step, torch::rand({4})));
}

}  // namespace
}  // namespace gpipe
