// Threads that follow the plan (Note [Threads that follow the plan] in
// src/engine/lane_threads.cpp): which cells of a plan get every core, and
// that the lanes run them with that count.

#include "engine/lane_threads.h"

#include <ATen/Parallel.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device.h"

namespace gpipe {
namespace {

using detail::threads_of_cells;

// The thread counts of `plan`'s compute cells on lane `l`, keyed by
// (micro-batch, phase).
std::map<std::pair<int64_t, Phase>, int64_t> compute_threads(
    const Plan& plan,
    const std::vector<std::vector<int64_t>>& threads,
    size_t l) {
  std::map<std::pair<int64_t, Phase>, int64_t> out;
  for (size_t k = 0; k < plan.lanes[l].size(); ++k) {
    const auto& c = plan.lanes[l][k];
    if (c.phase == Phase::Loss) {
      EXPECT_EQ(threads[l][k], 0) << "a loss takes no time step";
      continue;
    }
    out[{c.micro_batch, c.phase}] = threads[l][k];
  }
  return out;
}

TEST(LaneThreadsTest, EveryCellTakesEveryCoreAtChunksOne) {
  for (const auto schedule : {Schedule::FillDrain, Schedule::OneFOneB}) {
    const auto plan = training_plan(schedule, 1, 2);
    const auto threads = threads_of_cells(plan, {true, true}, 4);
    for (size_t l = 0; l < 2; ++l) {
      for (const auto& [cell, count] : compute_threads(plan, threads, l)) {
        EXPECT_EQ(count, 4) << to_string(schedule) << ", lane " << l;
      }
    }
  }
}

TEST(LaneThreadsTest, APlanWhoseLanesOverlapSharesTheCoresBetween) {
  // Fill-drain at chunks 4: the fill and the drain run alone and may take
  // every core (Note [Wide cells on the calling thread]); the lanes
  // overlap in between, so those cells get half.
  const auto plan = training_plan(Schedule::FillDrain, 4, 2);
  const auto threads = threads_of_cells(plan, {true, true}, 4);
  for (size_t l = 0; l < 2; ++l) {
    for (const auto& [cell, count] : compute_threads(plan, threads, l)) {
      const auto [i, phase] = cell;
      // Lane 0 alone: its first forward and last backward; lane 1: its
      // last forward and first backward.
      const bool alone = l == 0 ? (i == 0) : (i == 3);
      EXPECT_EQ(count, alone ? 4 : 2) << "lane " << l << ", micro-batch " << i;
    }
  }
  // Zero bubble at chunks 1: the last lane's W runs while lane 0 makes its
  // input's gradient, so those two get half; the forwards and the last
  // lane's B run alone.
  const auto zb = training_plan(Schedule::ZeroBubble, 1, 2);
  const auto zb_threads = threads_of_cells(zb, {true, true}, 4);
  std::map<std::pair<int64_t, Phase>, int64_t> expected[2] = {
      {{{0, Phase::Forward}, 4},
       {{0, Phase::BackwardInput}, 2},
       {{0, Phase::BackwardWeight}, 4}},
      {{{0, Phase::Forward}, 4},
       {{0, Phase::BackwardInput}, 4},
       {{0, Phase::BackwardWeight}, 2}}};
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_EQ(compute_threads(zb, zb_threads, l), expected[l])
        << "zero bubble, lane " << l;
  }
}

TEST(LaneThreadsTest, LanesOutsideTheShareKeepTheirCount) {
  const auto plan = training_plan(Schedule::FillDrain, 4, 2);
  const auto threads = threads_of_cells(plan, {true, false}, 3);
  for (const auto& [cell, count] : compute_threads(plan, threads, 0)) {
    EXPECT_EQ(count, 3) << "no lane shares lane 0's cores";
  }
  for (const auto& [cell, count] : compute_threads(plan, threads, 1)) {
    EXPECT_EQ(count, 0) << "lane 1 is not one of the sharing lanes";
  }
}

TEST(LaneThreadsTest, SettingAThreadsCountLeavesOtherThreadsAlone) {
  at::set_num_threads(1);
  int64_t seen_inside = 0;
  std::thread other([&] {
    at::internal::lazy_init_num_threads();
    detail::set_intra_op_threads(3);
    seen_inside = at::get_num_threads();
  });
  other.join();
  EXPECT_EQ(seen_inside, 3);
  EXPECT_EQ(at::get_num_threads(), 1);
}

TEST(LaneThreadsTest, LanesLeaveTheCallersCountAlone) {
  // A user sets a count, then builds a GPipe before running anything
  // parallel: the lanes' own counts must not become the caller's.
  int64_t seen = 0;
  std::thread user([&] {
    at::set_num_threads(3);
    torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    GPipe model(net, GPipeOptions({1, 1}).threads_per_lane(1));
    model->forward(torch::ones({2, 4}));
    seen = at::get_num_threads();
  });
  user.join();
  EXPECT_EQ(seen, 3);
}

// Records the intra-op thread count each micro-batch's forward ran with.
struct ThreadsSeenImpl : torch::nn::Module {
  std::mutex mutex;
  std::vector<int64_t> seen;
  torch::Tensor forward(torch::Tensor x) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.push_back(at::get_num_threads());
    return x * 2;
  }
};
TORCH_MODULE(ThreadsSeen);

struct Recorded {
  std::vector<int64_t> first;
  std::vector<int64_t> last;
};

Recorded threads_seen(int64_t chunks, int64_t threads_per_lane) {
  ThreadsSeen a;
  ThreadsSeen b;
  torch::nn::Sequential net(a, torch::nn::Linear(4, 4), b);
  GPipe model(
      net,
      GPipeOptions({2, 1})
          .chunks(chunks)
          .checkpoint(Checkpoint::Never)
          .threads_per_lane(threads_per_lane));
  model->forward(torch::ones({chunks, 4})).sum().backward();
  return {a->seen, b->seen};
}

TEST(LaneThreadsTest, ALaneThePlanRunsAloneUsesEveryCore) {
  const int64_t cores = detail::available_cores();
  if (cores < 2) {
    // Skipped: needs 2 cores: one-core machines, scripts/tsan.sh
    GTEST_SKIP()  // needs 2 cores: one-core machines, scripts/tsan.sh
        << "one core (or OMP_NUM_THREADS=1): nothing to share";
  }
  // One micro-batch: no two lanes ever run at once.
  auto seen = threads_seen(1, 0);
  EXPECT_EQ(seen.first, std::vector<int64_t>({cores}));
  EXPECT_EQ(seen.last, std::vector<int64_t>({cores}));
  // Four: the lanes overlap, so each runs with its own share, the fill and
  // the drain included.
  const auto half = std::max<int64_t>(1, cores / 2);
  seen = threads_seen(4, 0);
  EXPECT_EQ(seen.first, std::vector<int64_t>({half, half, half, half}));
  EXPECT_EQ(seen.last, std::vector<int64_t>({half, half, half, half}));
  // A count given is kept.
  seen = threads_seen(1, 1);
  EXPECT_EQ(seen.first, std::vector<int64_t>({1}));
  EXPECT_EQ(seen.last, std::vector<int64_t>({1}));
}

// Records the thread each forward ran on.
struct ThreadOfImpl : torch::nn::Module {
  std::mutex mutex;
  std::vector<std::thread::id> seen;
  torch::Tensor forward(torch::Tensor x) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.push_back(std::this_thread::get_id());
    return x + 1;
  }
};
TORCH_MODULE(ThreadOf);

// Throws a c10::ValueError from its first forward.
struct FailOnceImpl : torch::nn::Module {
  bool armed = true;
  torch::Tensor forward(torch::Tensor x) {
    if (armed) {
      armed = false;
      TORCH_CHECK_VALUE(false, "boom");
    }
    return x * 3;
  }
};
TORCH_MODULE(FailOnce);

TEST(LaneThreadsTest, ASerialPlanRunsOnTheCallingThread) {
  if (detail::available_cores() < 2) {
    // Skipped: needs 2 cores: one-core machines, scripts/tsan.sh
    GTEST_SKIP()  // needs 2 cores: one-core machines, scripts/tsan.sh
        << "one core (or OMP_NUM_THREADS=1): nothing to share";
  }
  // Note [A serial plan on the calling thread]: at chunks 1 both
  // partitions compute on the caller's thread, forward and backward; with
  // a count given, each on its own lane; at chunks 2 the lanes overlap and
  // each partition runs on its lane.
  struct Case {
    int64_t threads;
    int64_t chunks;
  };
  for (const auto c : {Case{0, 1}, Case{1, 1}, Case{0, 2}}) {
    ThreadOf a;
    ThreadOf b;
    GPipe model(
        torch::nn::Sequential(a, torch::nn::Linear(2, 2), b),
        GPipeOptions({2, 1})
            .chunks(c.chunks)
            .checkpoint(Checkpoint::Always)
            .threads_per_lane(c.threads));
    model->forward(torch::ones({c.chunks, 2})).sum().backward();
    // Each forward once, and again when backward recomputes it.
    ASSERT_EQ(a->seen.size(), 2u * c.chunks);
    ASSERT_EQ(b->seen.size(), 2u * c.chunks);
    const auto caller = std::this_thread::get_id();
    for (size_t k = 0; k < a->seen.size(); ++k) {
      if (c.threads == 0 && c.chunks == 1) {
        EXPECT_EQ(a->seen[k], caller) << k;
        EXPECT_EQ(b->seen[k], caller) << k;
      } else {
        EXPECT_NE(a->seen[k], caller) << k;
        EXPECT_NE(b->seen[k], caller) << k;
        EXPECT_NE(a->seen[k], b->seen[k]) << k;
      }
    }
  }
}

TEST(LaneThreadsTest, OneCpuLaneRunsOnTheCallingThreadWithItsCount) {
  // A pipeline of one CPU lane runs each cell alone, at any chunks and
  // under any schedule: on the calling thread, forward, loss and backward,
  // with the lane's count, and the caller has its own count back after.
  const auto before = at::get_num_threads();
  for (const int64_t threads : {int64_t{1}, int64_t{0}}) {
    ThreadOf a;
    ThreadsSeen counts;
    GPipe model(
        torch::nn::Sequential(a, torch::nn::Linear(2, 2), counts),
        GPipeOptions({2, 1})
            .chunks(4)
            .stages_per_lane(2)
            .checkpoint(Checkpoint::Always)
            .threads_per_lane(threads));
    const auto lane_count = model->threads_per_lane();
    detail::set_intra_op_threads(1);
    model->forward(torch::ones({4, 2})).sum().backward();
    model->train_step(
        torch::ones({4, 2}),
        torch::zeros({4, 2}),
        [&](torch::Tensor out, torch::Tensor y) {
          {
            std::lock_guard<std::mutex> lock(a->mutex);
            a->seen.push_back(std::this_thread::get_id());
          }
          return torch::mse_loss(out, y);
        },
        Schedule::OneFOneB);
    EXPECT_EQ(at::get_num_threads(), 1) << threads;
    // Forwards and recomputations of both passes, and the losses.
    ASSERT_EQ(a->seen.size(), 2u * 8 + 4) << threads;
    for (const auto& id : a->seen) {
      EXPECT_EQ(id, std::this_thread::get_id()) << threads;
    }
    for (const auto n : counts->seen) {
      EXPECT_EQ(n, lane_count) << threads;
    }
  }
  detail::set_intra_op_threads(before);
}

TEST(LaneThreadsTest, ASerialPlanGivesTheCallerItsCountBack) {
  if (detail::available_cores() < 2) {
    // Skipped: needs 2 cores: one-core machines, scripts/tsan.sh
    GTEST_SKIP()  // needs 2 cores: one-core machines, scripts/tsan.sh
        << "one core (or OMP_NUM_THREADS=1): nothing to share";
  }
  // The caller's thread runs the serial plan with every core, then has its
  // own count again, after a pass that failed too.
  std::vector<int64_t> after;
  std::vector<int64_t> during;
  std::thread user([&] {
    detail::set_intra_op_threads(1);
    ThreadsSeen seen;
    FailOnce fail;
    GPipe model(
        torch::nn::Sequential(seen, torch::nn::Linear(4, 4), fail),
        GPipeOptions({2, 1}).chunks(1));
    EXPECT_THROW(model->forward(torch::ones({2, 4})), c10::ValueError);
    after.push_back(at::get_num_threads());
    model->forward(torch::ones({2, 4})).sum().backward();
    after.push_back(at::get_num_threads());
    during = seen->seen;
  });
  user.join();
  EXPECT_EQ(after, std::vector<int64_t>({1, 1}));
  EXPECT_EQ(
      during,
      std::vector<int64_t>(
          {detail::available_cores(), detail::available_cores()}));
}

TEST(LaneThreadsTest, AnErrorInASerialPlanIsTheCellsAndTheModelGoesOn) {
  torch::nn::Linear first(2, 2);
  GPipe model(
      torch::nn::Sequential(first, FailOnce()), GPipeOptions({1, 1}).chunks(1));
  try {
    model->forward(torch::ones({1, 2}));
    FAIL() << "expected the layer's error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("partition 1, micro-batch 0"),
        std::string::npos)
        << e.what();
  }
  const auto x = torch::randn({3, 2});
  EXPECT_TRUE(torch::allclose(model->forward(x), first->forward(x) * 3));
}

TEST(LaneThreadsTest, OnlyTheDefaultFollowsThePlan) {
  if (detail::available_cores() < 2) {
    // Skipped: needs 2 cores: one-core machines, scripts/tsan.sh
    GTEST_SKIP()  // needs 2 cores: one-core machines, scripts/tsan.sh
        << "one core (or OMP_NUM_THREADS=1): nothing to share";
  }
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  EXPECT_TRUE(GPipe(net, GPipeOptions({1, 1}))->threads_follow_plan());
  torch::nn::Sequential other(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  EXPECT_FALSE(GPipe(other, GPipeOptions({1, 1}).threads_per_lane(1))
                   ->threads_follow_plan());
  torch::nn::Sequential one(torch::nn::Linear(4, 4));
  EXPECT_FALSE(GPipe(one, GPipeOptions({1}))->threads_follow_plan())
      << "a single lane has every core anyway";
}

TEST(LaneThreadsTest, OmpNumThreadsCapsTheSharedCores) {
  // As LibTorch's default: OMP_NUM_THREADS=1 leaves one thread per lane and
  // nothing to share.
  const char* before = std::getenv("OMP_NUM_THREADS");
  const std::string saved = before != nullptr ? before : "";
  setenv("OMP_NUM_THREADS", "1", 1);
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  GPipe model(net, GPipeOptions({1, 1}));
  if (before != nullptr) {
    setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  } else {
    unsetenv("OMP_NUM_THREADS");
  }
  EXPECT_FALSE(model->threads_follow_plan());
  EXPECT_EQ(model->threads_per_lane(), 1);
}

TEST(LaneThreadsTest, SharedThreadsTrainAsFixedOnes) {
  torch::manual_seed(0);
  auto make = [] {
    torch::manual_seed(1);
    torch::nn::Sequential net;
    for (int k = 0; k < 4; ++k) {
      net->push_back(torch::nn::Linear(64, 64));
      net->push_back(torch::nn::Tanh());
    }
    net->to(torch::kFloat64);
    return net;
  };
  const auto x = torch::randn({16, 64}, torch::kFloat64);
  const auto y = torch::randn({16, 64}, torch::kFloat64);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  };
  // Every schedule, at chunks 1 (every cell on the calling thread) and 4.
  struct Case {
    GPipeOptions options;
    Schedule schedule;
  };
  std::vector<Case> cases;
  for (const int64_t chunks : {1, 4}) {
    for (const auto schedule :
         {Schedule::FillDrain, Schedule::OneFOneB, Schedule::ZeroBubble}) {
      cases.push_back({GPipeOptions({4, 4}).chunks(chunks), schedule});
    }
    // Recomputed in backward: at chunks 1 a reentrant backward on the
    // calling thread.
    cases.push_back(
        {GPipeOptions({4, 4}).chunks(chunks).checkpoint(Checkpoint::Always),
         Schedule::FillDrain});
    for (const auto schedule :
         {Schedule::Interleaved1F1B, Schedule::LoopedBFS}) {
      cases.push_back(
          {GPipeOptions({2, 2, 2, 2}).chunks(chunks).stages_per_lane(2),
           schedule});
    }
    cases.push_back(
        {GPipeOptions({2, 2, 2, 2})
             .chunks(chunks)
             .placement(Placement::v_shape(2)),
         Schedule::ZeroBubbleV});
  }
  for (const auto& c : cases) {
    std::vector<std::vector<torch::Tensor>> grads;
    for (const int64_t threads : {0, 1}) {
      auto options = c.options;
      GPipe model(make(), options.threads_per_lane(threads));
      model->train_step(x, y, loss_fn, c.schedule);
      std::vector<torch::Tensor> g;
      for (const auto& p : model->parameters()) {
        g.push_back(p.grad().clone());
      }
      grads.push_back(g);
    }
    for (size_t k = 0; k < grads[0].size(); ++k) {
      EXPECT_TRUE(torch::allclose(grads[0][k], grads[1][k], 0, 1e-10))
          << to_string(c.schedule) << ", chunks " << c.options.chunks()
          << ", parameter " << k;
    }
  }
}

}  // namespace
}  // namespace gpipe
