// Long cells that a plan runs alone take every core on the calling thread
// (Note [Wide cells on the calling thread] in src/engine/wide_cells.cpp): which
// cells go there, that they compute what the lanes compute, and that an
// error in one is the cell's.

#include <ATen/Parallel.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"
#include "device.h"
#include "engine/lane_threads.h"

namespace gpipe {
namespace {

// Where and with how many intra-op threads each forward ran; sleeps long
// enough for its cell to count as long (kWideCellSeconds) when `slow`, and
// throws once when armed.
struct SeenImpl : torch::nn::Module {
  struct Call {
    std::thread::id thread;
    int64_t threads;
  };
  explicit SeenImpl(bool slow) : slow(slow) {}
  bool slow;
  bool fail_next = false;
  std::mutex mutex;
  std::vector<Call> calls;
  torch::Tensor forward(torch::Tensor x) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      calls.push_back({std::this_thread::get_id(), at::get_num_threads()});
      if (fail_next) {
        fail_next = false;
        TORCH_CHECK_VALUE(false, "boom in a long cell");
      }
    }
    if (slow) {
      std::this_thread::sleep_for(
          std::chrono::duration<double>(detail::kWideCellSeconds * 1.5));
    }
    return x * 2;
  }
};
TORCH_MODULE(Seen);

class WideCellsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (detail::available_cores() < 2) {
      // Skipped: needs 2 cores: one-core machines, scripts/tsan.sh
      GTEST_SKIP()  // needs 2 cores: one-core machines, scripts/tsan.sh
          << "one core (or OMP_NUM_THREADS=1): nothing to share";
    }
  }
};

TEST_F(WideCellsTest, ALongCellThePlanRunsAloneTakesEveryCoreOnTheCaller) {
  const int64_t cores = detail::available_cores();
  const int64_t half = std::max<int64_t>(1, cores / 2);
  const auto caller = std::this_thread::get_id();
  const auto own = at::get_num_threads();
  for (const bool slow : {true, false}) {
    Seen a(slow);
    Seen b(slow);
    GPipe model(
        torch::nn::Sequential(a, torch::nn::Linear(2, 2), b),
        GPipeOptions({2, 1}).chunks(4).checkpoint(Checkpoint::Never));
    torch::NoGradGuard no_grad;
    // The first pass measures the cells on their lanes.
    model->forward(torch::ones({4, 2}));
    a->calls.clear();
    b->calls.clear();
    model->forward(torch::ones({4, 2}));
    ASSERT_EQ(a->calls.size(), 4u);
    ASSERT_EQ(b->calls.size(), 4u);
    // Fill-drain at chunks 4 on 2 lanes: micro-batch 0 on lane 0 and
    // micro-batch 3 on lane 1 run alone.
    for (size_t i = 0; i < 4; ++i) {
      const bool a_alone = slow && i == 0;
      const bool b_alone = slow && i == 3;
      EXPECT_EQ(a->calls[i].thread == caller, a_alone)
          << "slow " << slow << ", micro-batch " << i;
      EXPECT_EQ(a->calls[i].threads, a_alone ? cores : half)
          << "slow " << slow << ", micro-batch " << i;
      EXPECT_EQ(b->calls[i].thread == caller, b_alone)
          << "slow " << slow << ", micro-batch " << i;
      EXPECT_EQ(b->calls[i].threads, b_alone ? cores : half)
          << "slow " << slow << ", micro-batch " << i;
    }
    // The caller has its own count back.
    EXPECT_EQ(at::get_num_threads(), own);
  }
  // A count given is kept: nothing goes to the caller.
  Seen a(true);
  GPipe model(
      torch::nn::Sequential(a, torch::nn::Linear(2, 2), Seen(true)),
      GPipeOptions({2, 1}).chunks(4).threads_per_lane(1));
  torch::NoGradGuard no_grad;
  model->forward(torch::ones({4, 2}));
  a->calls.clear();
  model->forward(torch::ones({4, 2}));
  for (const auto& call : a->calls) {
    EXPECT_NE(call.thread, caller);
    EXPECT_EQ(call.threads, 1);
  }
}

TEST_F(WideCellsTest, ACellThatGotShortGoesBackToItsLane) {
  // Zero bubble at chunks 1: each stage's forward runs alone, so once its
  // cells are long every one of them runs wide, and only the wide runs
  // can tell that they got short.
  Seen a(true);
  Seen b(true);
  GPipe model(
      torch::nn::Sequential(a, torch::nn::Linear(2, 2), b),
      GPipeOptions({2, 1}).chunks(1));
  const auto x = torch::ones({2, 2});
  const auto y = torch::ones({2, 2});
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  };
  const auto caller = std::this_thread::get_id();
  for (int step = 0; step < 2; ++step) {
    model->train_step(x, y, loss_fn, Schedule::ZeroBubble);
  }
  ASSERT_FALSE(a->calls.empty());
  EXPECT_EQ(a->calls.back().thread, caller);
  a->slow = false;
  b->slow = false;
  for (int step = 0; step < 2; ++step) {
    model->train_step(x, y, loss_fn, Schedule::ZeroBubble);
  }
  EXPECT_NE(a->calls.back().thread, caller);
  EXPECT_NE(b->calls.back().thread, caller);
}

TEST_F(WideCellsTest, AnErrorInALongCellIsTheCellsAndTheModelGoesOn) {
  Seen a(true);
  GPipe model(
      torch::nn::Sequential(a, torch::nn::Linear(2, 2), Seen(true)),
      GPipeOptions({2, 1}).chunks(4));
  const auto x = torch::ones({4, 2});
  model->forward(x).sum().backward();
  a->calls.clear();
  a->fail_next = true;  // micro-batch 0, the fill: on the calling thread
  try {
    model->forward(x);
    FAIL() << "the failing cell did not fail the pass";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("boom in a long cell"), std::string::npos) << what;
    EXPECT_NE(what.find("partition 0, micro-batch 0"), std::string::npos)
        << what;
  }
  ASSERT_FALSE(a->calls.empty());
  EXPECT_EQ(a->calls.front().thread, std::this_thread::get_id());
  const auto out = model->forward(x);
  EXPECT_TRUE(torch::allclose(out, model->forward(x)));
  out.sum().backward();
}

TEST_F(WideCellsTest, WideCellsTrainAsLanesDo) {
  // Float64 layers between slow ones, so that the fill and the drain go to
  // the calling thread (the backward's too: every micro-batch is
  // recomputed); three steps, as the first only measures.
  std::vector<Seen> seen;
  auto make = [&seen] {
    torch::manual_seed(1);
    torch::nn::Sequential net;
    for (int k = 0; k < 2; ++k) {
      seen.push_back(Seen(true));
      net->push_back(seen.back());
      net->push_back(torch::nn::Linear(16, 16));
      net->push_back(torch::nn::Tanh());
    }
    net->to(torch::kFloat64);
    return net;
  };
  torch::manual_seed(0);
  const auto x = torch::randn({8, 16}, torch::kFloat64);
  const auto y = torch::randn({8, 16}, torch::kFloat64);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  };
  const auto caller = std::this_thread::get_id();
  struct Case {
    Schedule schedule;
    int64_t chunks;
  };
  // Zero bubble at chunks 1 is not serial (a W beside a B), and its first
  // two forwards, on two lanes, both run alone, the second on the first's
  // output.
  for (const auto c :
       {Case{Schedule::FillDrain, 4},
        Case{Schedule::OneFOneB, 4},
        Case{Schedule::ZeroBubble, 4},
        Case{Schedule::ZeroBubble, 1}}) {
    const auto schedule = c.schedule;
    std::vector<std::vector<torch::Tensor>> grads;
    for (const int64_t threads : {0, 1}) {
      seen.clear();
      GPipe model(
          make(),
          GPipeOptions({3, 3})
              .chunks(c.chunks)
              .checkpoint(Checkpoint::Always)
              .threads_per_lane(threads));
      for (int step = 0; step < 3; ++step) {
        model->zero_grad();
        model->train_step(x, y, loss_fn, schedule);
      }
      int64_t on_caller = 0;
      for (auto& s : seen) {
        for (const auto& call : s->calls) {
          on_caller += call.thread == caller ? 1 : 0;
        }
      }
      if (threads == 0) {
        EXPECT_GT(on_caller, 0) << to_string(schedule) << " " << c.chunks;
      } else {
        EXPECT_EQ(on_caller, 0) << to_string(schedule) << " " << c.chunks;
      }
      grads.push_back(testing::grads_of(*model));
    }
    for (size_t k = 0; k < grads[0].size(); ++k) {
      EXPECT_TRUE(torch::allclose(grads[0][k], grads[1][k], 0, 1e-10))
          << to_string(schedule) << " at chunks " << c.chunks << ", parameter "
          << k;
    }
  }
}

}  // namespace
}  // namespace gpipe
