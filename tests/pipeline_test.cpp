// The pipeline as it runs: lanes in parallel, cells in schedule order.

#include "engine/pipeline.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "common.h"

namespace {

using gpipe::testing::lambda;
using gpipe::testing::SeededTest;

class PipelineTest : public SeededTest {};

using Clock = std::chrono::steady_clock;

struct Event {
  int partition;
  bool recomputing;
  Clock::time_point start;
  Clock::time_point end;
  std::thread::id thread;
};

TEST_F(PipelineTest, PartitionsRunOnTheirOwnThreadsAtTheSameTime) {
  std::mutex mutex;
  std::vector<Event> events;
  auto sleeper = [&](int partition) {
    return lambda([&, partition](torch::Tensor x) {
      Event e{
          partition,
          gpipe::is_recomputing(),
          Clock::now(),
          {},
          std::this_thread::get_id()};
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      e.end = Clock::now();
      std::lock_guard<std::mutex> lock(mutex);
      events.push_back(e);
      return x * 2;
    });
  };
  gpipe::GPipe model(
      torch::nn::Sequential(sleeper(0), sleeper(1)),
      gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(
          gpipe::Checkpoint::Never));
  auto x = torch::ones({8, 1}, torch::requires_grad());
  auto t0 = Clock::now();
  auto y = model->forward(x);
  auto elapsed = Clock::now() - t0;
  // Serial: 8 x 50 ms. Pipelined: (4 + 2 - 1) x 50 ms.
  EXPECT_LT(elapsed, std::chrono::milliseconds(350));
  ASSERT_EQ(events.size(), 8u);
  std::thread::id lanes[2];
  bool overlapped = false;
  for (const auto& a : events) {
    lanes[a.partition] = a.thread;
    for (const auto& b : events) {
      if (a.partition == 0 && b.partition == 1 && a.start < b.end &&
          b.start < a.end) {
        overlapped = true;
      }
    }
  }
  EXPECT_TRUE(overlapped);
  EXPECT_NE(lanes[0], lanes[1]);
  EXPECT_NE(lanes[0], std::this_thread::get_id());
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), torch::full({8, 1}, 4.0)));
}

TEST_F(PipelineTest, BackwardOfPartitionsOverlaps) {
  std::mutex mutex;
  std::vector<std::pair<int, std::pair<Clock::time_point, Clock::time_point>>>
      spans;
  auto slow_backward = [&](int partition) {
    return lambda([&, partition](torch::Tensor x) {
      // A hook that sleeps in backward on this partition's lane.
      auto y = x * 1.0;
      y.register_hook([&, partition](torch::Tensor g) {
        auto start = Clock::now();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::lock_guard<std::mutex> lock(mutex);
        spans.push_back({partition, {start, Clock::now()}});
        return g;
      });
      return y;
    });
  };
  gpipe::GPipe model(
      torch::nn::Sequential(slow_backward(0), slow_backward(1)),
      gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(
          gpipe::Checkpoint::Never));
  auto y = model->forward(torch::ones({8, 1}, torch::requires_grad()));
  auto t0 = Clock::now();
  y.sum().backward();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(350));
  ASSERT_EQ(spans.size(), 8u);
  bool overlapped = false;
  for (const auto& a : spans) {
    for (const auto& b : spans) {
      if (a.first == 0 && b.first == 1 && a.second.first < b.second.second &&
          b.second.first < a.second.second) {
        overlapped = true;
      }
    }
  }
  EXPECT_TRUE(overlapped);
}

TEST_F(PipelineTest, LanesSeeMicroBatchesInScheduleOrder) {
  std::mutex mutex;
  std::vector<std::pair<int, int64_t>> order;  // (partition, first value)
  auto log = [&](int partition) {
    return lambda([&, partition](torch::Tensor x) {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back({partition, x[0][0].item<int64_t>()});
      return x;
    });
  };
  gpipe::GPipe model(
      torch::nn::Sequential(log(0), log(1), log(2)),
      gpipe::GPipeOptions({1, 1, 1}).chunks(5));
  model->forward(torch::arange(5).view({5, 1}));
  for (int j = 0; j < 3; ++j) {
    std::vector<int64_t> seen;
    for (const auto& e : order) {
      if (e.first == j) {
        seen.push_back(e.second);
      }
    }
    EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4})) << "partition " << j;
  }
}

TEST_F(PipelineTest, ThreadLocalStateReachesTheLanes) {
  std::atomic<bool> inference{false};
  std::atomic<bool> grad{true};
  auto probe = lambda([&](torch::Tensor x) {
    inference = c10::InferenceMode::is_enabled();
    grad = torch::GradMode::is_enabled();
    return x;
  });
  gpipe::GPipe model(
      torch::nn::Sequential(torch::nn::Identity(), probe),
      gpipe::GPipeOptions({1, 1}));
  {
    c10::InferenceMode guard;
    model->forward(torch::ones({2, 2}));
  }
  EXPECT_TRUE(inference.load());
  {
    torch::NoGradGuard guard;
    model->forward(torch::ones({2, 2}));
  }
  EXPECT_FALSE(grad.load());
  model->forward(torch::ones({2, 2}));
  EXPECT_TRUE(grad.load());
}

TEST_F(PipelineTest, CpuLanesUseTheirThreadCount) {
  std::atomic<int> threads{0};
  auto probe = lambda([&](torch::Tensor x) {
    threads = at::get_num_threads();
    return x;
  });
  gpipe::GPipe model(
      torch::nn::Sequential(torch::nn::Identity(), probe),
      gpipe::GPipeOptions({1, 1}).threads_per_lane(1));
  EXPECT_EQ(model->threads_per_lane(), 1);
  model->forward(torch::ones({2, 2}));
  EXPECT_EQ(threads.load(), 1);
}

}  // namespace

namespace {

// A process builds stages only for its own partitions (gpipe::dist gives
// each rank some): the others have no Stage, so nothing of theirs is
// walked each pass.
TEST_F(PipelineTest, OnlyLocalPartitionsGetStages) {
  std::vector<torch::nn::Sequential> parts{
      torch::nn::Sequential(torch::nn::Linear(3, 3)),
      torch::nn::Sequential(torch::nn::Linear(3, 3))};
  gpipe::detail::Pipeline pipeline(
      parts, {torch::kCPU, torch::kCPU}, 1, {true, false}, gpipe::Placement());
  EXPECT_TRUE(pipeline.is_local(0));
  EXPECT_FALSE(pipeline.is_local(1));
  EXPECT_EQ(pipeline.stage(0).index(), 0);
  EXPECT_THROW(pipeline.stage(1), c10::Error);
  // A pass starts with only the local stage refreshed.
  auto pass = pipeline.start_pass(1, {}, gpipe::detail::PassOptions{});
  EXPECT_TRUE(pass->grad);
}

}  // namespace
