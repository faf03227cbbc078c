#include <c10/core/CPUAllocator.h>
#include <c10/util/irange.h>
#include <gpipe/autotune.h>
#include <gpipe/balance.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace {

using gpipe::testing::SeededTest;

class BalanceTest : public SeededTest {};

template <typename F>
void expect_value_error(F&& f, const std::string& expected) {
  try {
    f();
    ADD_FAILURE() << "expected c10::ValueError containing: " << expected;
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace()).find(expected),
        std::string::npos)
        << "message: " << e.what_without_backtrace()
        << "\nexpected: " << expected;
  }
}

std::vector<int64_t> lengths(const std::vector<std::vector<double>>& blocks) {
  std::vector<int64_t> out;
  for (const auto& b : blocks) {
    out.push_back(static_cast<int64_t>(b.size()));
  }
  return out;
}

std::vector<double> doubles(const std::vector<int>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// ---------------------------------------------------------------------------
// Layers.

/// Sleeps `ms` milliseconds and passes its input on (Cloneable).
struct SleepImpl : torch::nn::Cloneable<SleepImpl> {
  explicit SleepImpl(int ms) : ms(ms) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x;
  }
  int ms;
};
TORCH_MODULE(Sleep);

/// The same as a plain torch::nn::Module, whose clone() throws.
struct PlainSleepImpl : torch::nn::Module {
  explicit PlainSleepImpl(int ms) : ms(ms) {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x;
  }
  int ms;
};
TORCH_MODULE(PlainSleep);

/// Sleeps, then stashes x * x under "skip" and returns x * x + 1. (x * x
/// saves x for backward: a backward that went through it twice would fail.)
struct StashSleepImpl : torch::nn::Cloneable<StashSleepImpl>, gpipe::Skippable {
  explicit StashSleepImpl(int ms) : gpipe::Skippable({"skip"}, {}), ms(ms) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    auto y = x * x;
    stash("skip", y);
    return y + 1;
  }
  int ms;
};
TORCH_MODULE(StashSleep);

/// Sleeps, then returns x + the tensor stashed under "skip".
struct PopSleepImpl : torch::nn::Cloneable<PopSleepImpl>, gpipe::Skippable {
  explicit PopSleepImpl(int ms) : gpipe::Skippable({}, {"skip"}), ms(ms) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x + pop("skip");
  }
  int ms;
};
TORCH_MODULE(PopSleep);

/// (batch, 16) -> (batch, 1024): a big activation and no parameters.
struct RepeatImpl : torch::nn::Cloneable<RepeatImpl> {
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    return x.repeat({1, 64});
  }
};
TORCH_MODULE(Repeat);

/// (batch, 1024) -> (batch, 16) by summing the 64 copies.
struct ShrinkImpl : torch::nn::Cloneable<ShrinkImpl> {
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    return x.view({x.size(0), 64, 16}).sum(1);
  }
};
TORCH_MODULE(Shrink);

/// Stashes a big (batch, 1024) tensor under "big", returns x * 1.
struct StashBigImpl : torch::nn::Cloneable<StashBigImpl>, gpipe::Skippable {
  StashBigImpl() : gpipe::Skippable({"big"}, {}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    stash("big", x.repeat({1, 64}));
    return x * 1;
  }
};
TORCH_MODULE(StashBig);

/// Pops "big" and adds its 64 copies summed to x.
struct PopShrinkImpl : torch::nn::Cloneable<PopShrinkImpl>, gpipe::Skippable {
  PopShrinkImpl() : gpipe::Skippable({}, {"big"}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    auto big = pop("big");
    return x + big.view({x.size(0), 64, 16}).sum(1);
  }
};
TORCH_MODULE(PopShrink);

/// Allocates and frees scratch memory through the CPU allocator's raw
/// interface, as oneDNN does.
struct RawScratchImpl : torch::nn::Cloneable<RawScratchImpl> {
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    void* p = c10::GetCPUAllocator()->raw_allocate(4096);
    c10::GetCPUAllocator()->raw_deallocate(p);
    return x;
  }
};
TORCH_MODULE(RawScratch);

/// A plain torch::nn::Module (not Cloneable) with a parameter, a buffer it
/// bumps in training and a BatchNorm child.
struct ScaleNormImpl : torch::nn::Module {
  explicit ScaleNormImpl(int64_t features) {
    scale = register_parameter("scale", torch::ones({features}));
    calls = register_buffer("calls", torch::zeros({1}));
    norm = register_module("norm", torch::nn::BatchNorm1d(features));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (is_training()) {
      calls.add_(1);
    }
    return norm(x) * scale;
  }
  torch::Tensor scale;
  torch::Tensor calls;
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(ScaleNorm);

/// A plain torch::nn::Module that changes its own parameter in forward.
struct DriftImpl : torch::nn::Module {
  explicit DriftImpl(int64_t features) {
    weight = register_parameter("weight", torch::ones({features}));
  }
  torch::Tensor forward(torch::Tensor x) {
    {
      torch::NoGradGuard no_grad;
      weight.add_(0.5);
    }
    return x * weight;
  }
  torch::Tensor weight;
};
TORCH_MODULE(Drift);

/// Records whether it runs in training mode.
struct TrainingProbeImpl : torch::nn::Cloneable<TrainingProbeImpl> {
  explicit TrainingProbeImpl(std::shared_ptr<std::vector<bool>> seen)
      : seen(std::move(seen)) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    seen->push_back(is_training());
    return x;
  }
  std::shared_ptr<std::vector<bool>> seen;
};
TORCH_MODULE(TrainingProbe);

/// x -> (2x, x detached).
struct TwinImpl : torch::nn::Cloneable<TwinImpl> {
  void reset() override {}
  std::vector<torch::Tensor> forward(torch::Tensor x) {
    return {x * 2, x.detach()};
  }
};
TORCH_MODULE(Twin);

/// (a, b) -> a + b.
struct AddPairImpl : torch::nn::Cloneable<AddPairImpl> {
  void reset() override {}
  torch::Tensor forward(std::vector<torch::Tensor> xs) {
    return xs.at(0) + xs.at(1);
  }
};
TORCH_MODULE(AddPair);

/// x -> x.flatten(1).
struct FlattenImpl : torch::nn::Cloneable<FlattenImpl> {
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    return x.flatten(1);
  }
};
TORCH_MODULE(Flatten);

// ---------------------------------------------------------------------------
// Block partition.

TEST_F(BalanceTest, BlockPartitionSolvesTorchgpipesCases) {
  using Blocks = std::vector<std::vector<double>>;
  EXPECT_EQ(
      gpipe::solve_block_partition({1, 2, 3, 4, 5, 6}, 2),
      (Blocks{{1, 2, 3, 4}, {5, 6}}));
  EXPECT_EQ(gpipe::solve_block_partition({0, 0}, 2), (Blocks{{0}, {0}}));
  EXPECT_EQ(gpipe::solve_block_partition({42}, 1), (Blocks{{42}}));
}

TEST_F(BalanceTest, BlockPartitionMatchesTorchgpipeOnRandomSequences) {
  // Block lengths from torchgpipe's blockpartition.solve (Python) on these
  // sequences; the even split is not among them.
  struct Case {
    std::vector<int> sequence;
    int64_t partitions;
    std::vector<int64_t> lengths;
  };
  const std::vector<Case> cases = {
      {{11, 13, 16, 19, 6, 9, 17, 10, 16}, 5, {2, 1, 1, 3, 2}},
      {{12, 10, 11, 6, 10, 13, 13, 10, 18, 6}, 4, {2, 3, 2, 3}},
      {{7, 6, 1, 7, 0, 8, 16, 10, 18, 13}, 5, {2, 4, 1, 2, 1}},
      {{10, 20, 19, 7, 7, 14, 11, 4}, 2, {3, 5}},
      {{10, 14, 5, 4, 10, 6, 18}, 4, {1, 1, 3, 2}},
      {{3, 5, 0, 4, 14, 7, 11, 7, 2}, 2, {5, 4}},
      {{13, 6, 2, 9, 9, 8, 4, 18}, 5, {1, 3, 1, 1, 2}},
      {{1, 18, 17, 12, 20, 2}, 4, {2, 1, 1, 2}},
      // Equal maximal blocks: torchgpipe's max() takes the last.
      {{6, 3, 6, 5, 1, 1, 3, 5, 1, 6}, 4, {2, 2, 4, 2}},
      {{4, 6, 6, 3, 1, 2, 5, 6, 5}, 3, {2, 5, 2}},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(
        lengths(
            gpipe::solve_block_partition(doubles(c.sequence), c.partitions)),
        c.lengths)
        << "sequence of " << c.sequence.size() << " starting with "
        << c.sequence[0] << ", partitions " << c.partitions;
  }
}

TEST_F(BalanceTest, BlockPartitionEndsWhereTorchgpipeLoopsForever) {
  // torchgpipe's solve() never returns here: it takes the leftmost minimal
  // block, not the one closest to the maximal block, and boundaries cross.
  const auto blocks =
      gpipe::solve_block_partition({2, 1, 0, 0, 5, 0, 0, 4, 3}, 8);
  EXPECT_EQ(lengths(blocks), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 2, 1}));
}

TEST_F(BalanceTest, BlockPartitionRejectsBadArguments) {
  expect_value_error(
      [] { gpipe::solve_block_partition({42}, 0); },
      "partitions must be a positive integer (0 < 1)");
  expect_value_error(
      [] { gpipe::solve_block_partition({42}, -1); },
      "partitions must be a positive integer (-1 < 1)");
  expect_value_error(
      [] { gpipe::solve_block_partition({}, 1); },
      "sequence is shorter than intended partitions (0 < 1)");
  expect_value_error(
      [] { gpipe::solve_block_partition({42}, 2); },
      "sequence is shorter than intended partitions (1 < 2)");
  expect_value_error(
      [] {
        gpipe::solve_block_partition(
            {1, std::numeric_limits<double>::quiet_NaN()}, 1);
      },
      "element 1 is nan");
  expect_value_error(
      [] {
        gpipe::balance_cost({1, 2}, 3);
      },
      "sequence is shorter than intended partitions (2 < 3)");
}

// The smallest possible largest block sum of `sequence` in `k` blocks.
double brute_force_min_max(const std::vector<double>& sequence, int64_t k) {
  const auto n = static_cast<int64_t>(sequence.size());
  double best = std::numeric_limits<double>::infinity();
  std::function<void(int64_t, int64_t, double)> go =
      [&](int64_t begin, int64_t blocks_left, double largest) {
        if (blocks_left == 1) {
          double sum = 0;
          for (int64_t i = begin; i < n; ++i) {
            sum += sequence[i];
          }
          best = std::min(best, std::max(largest, sum));
          return;
        }
        double sum = 0;
        for (int64_t end = begin + 1; end <= n - (blocks_left - 1); ++end) {
          sum += sequence[end - 1];
          go(end, blocks_left - 1, std::max(largest, sum));
        }
      };
  go(0, k, -std::numeric_limits<double>::infinity());
  return best;
}

double largest_sum(const std::vector<std::vector<double>>& blocks) {
  double largest = -std::numeric_limits<double>::infinity();
  for (const auto& b : blocks) {
    double sum = 0;
    for (const auto x : b) {
      sum += x;
    }
    largest = std::max(largest, sum);
  }
  return largest;
}

// `sequence` cut into blocks of the lengths `balance`, which must add up to
// its length.
std::vector<std::vector<double>> split(
    const std::vector<double>& sequence, const std::vector<int64_t>& balance) {
  std::vector<std::vector<double>> blocks;
  int64_t begin = 0;
  const auto n = static_cast<int64_t>(sequence.size());
  for (const auto length : balance) {
    if (length < 0 || begin + length > n) {
      ADD_FAILURE() << "balance does not fit a sequence of " << n;
      return blocks;
    }
    blocks.emplace_back(
        sequence.begin() + begin, sequence.begin() + begin + length);
    begin += length;
  }
  EXPECT_EQ(begin, n);
  return blocks;
}

TEST_F(BalanceTest, BlockPartitionAgainstBruteForce) {
  // std::mt19937's raw output is the same everywhere; the distributions of
  // <random> are not, hence the modulo.
  std::mt19937 gen(20240611);
  int cases = 0;
  int optimal = 0;
  double worst = 1;
  double ratio_sum = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t n = 1 + gen() % 8;
    const int64_t k = 1 + gen() % n;
    std::vector<double> sequence;
    for (int64_t i = 0; i < n; ++i) {
      const double u = static_cast<double>(gen() % 1000000) / 1e6;
      switch (trial % 3) {
        case 0:
          sequence.push_back(static_cast<double>(gen() % 6));
          break;
        case 1:
          sequence.push_back(u);
          break;
        default:
          sequence.push_back(100 * u * u * u * u);
      }
    }
    const auto blocks = gpipe::solve_block_partition(sequence, k);

    // k non-empty contiguous blocks that cover the sequence in order.
    ASSERT_EQ(static_cast<int64_t>(blocks.size()), k);
    std::vector<double> joined;
    for (const auto& b : blocks) {
      ASSERT_FALSE(b.empty());
      joined.insert(joined.end(), b.begin(), b.end());
    }
    ASSERT_EQ(joined, sequence);

    // The algorithm's own guarantee: on values scaled to [0, 1], the largest
    // block exceeds the smallest by at most 1.
    const auto [lo, hi] = std::minmax_element(sequence.begin(), sequence.end());
    const double range = *hi - *lo;
    if (range > 0) {
      double largest = -1;
      double smallest = std::numeric_limits<double>::infinity();
      for (const auto& b : blocks) {
        double s = 0;
        for (const auto x : b) {
          s += (x - *lo) / range;
        }
        largest = std::max(largest, s);
        smallest = std::min(smallest, s);
      }
      EXPECT_LE(largest, smallest + 1 + 1e-9);
    }

    const double best = brute_force_min_max(sequence, k);
    const double got = largest_sum(blocks);
    ASSERT_GE(got, best - 1e-9);
    ++cases;
    if (got <= best + 1e-9 * std::max(1.0, best)) {
      ++optimal;
    }
    const double ratio = best > 0 ? got / best : 1.0;
    worst = std::max(worst, ratio);
    ratio_sum += ratio;

    // balance_cost always reaches the optimum, and keeps Bárány's blocks
    // when they reach it too.
    const auto balance = gpipe::balance_cost(sequence, k);
    ASSERT_EQ(static_cast<int64_t>(balance.size()), k);
    for (const auto length : balance) {
      ASSERT_GE(length, 1);
    }
    const auto cost_blocks = split(sequence, balance);
    EXPECT_NEAR(largest_sum(cost_blocks), best, 1e-9 * std::max(1.0, best));
    if (got <= best + 1e-9 * std::max(1.0, best)) {
      EXPECT_EQ(balance, lengths(blocks));
    }
  }
  std::printf(
      "[ stats    ] Barany block partition vs brute force: optimal in %d of "
      "%d cases (%.1f%%), largest block / optimum: mean %.4f, worst %.4f\n",
      optimal,
      cases,
      100.0 * optimal / cases,
      ratio_sum / cases,
      worst);
}

TEST_F(BalanceTest, BalanceCostMinimisesTheLargestPartition) {
  // Bárány's stopping rule accepts [[100, 1], [1, 1]]: scaled to [0, 1]
  // that is [1, 0] against [0, 0], within one element.
  EXPECT_EQ(
      lengths(gpipe::solve_block_partition({100, 1, 1, 1}, 2)),
      (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(
      gpipe::balance_cost({100, 1, 1, 1}, 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(
      gpipe::balance_cost({1, 1, 100, 1, 1}, 3),
      (std::vector<int64_t>{2, 1, 2}));
  // Bárány's blocks can be far from the best: 7 against 3 here.
  const std::vector<double> uneven = {1, 3, 1, 1, 1, 1, 2, 1, 1, 2};
  EXPECT_EQ(largest_sum(gpipe::solve_block_partition(uneven, 6)), 7);
  EXPECT_EQ(brute_force_min_max(uneven, 6), 3);
  EXPECT_EQ(largest_sum(split(uneven, gpipe::balance_cost(uneven, 6))), 3);
  // Where Bárány's blocks are optimal they are kept.
  EXPECT_EQ(
      gpipe::balance_cost({1, 2, 3, 4, 5, 6}, 2), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(gpipe::balance_cost({0, 0}, 2), (std::vector<int64_t>{1, 1}));
  // Huge but finite costs split as their ratios do (1e160 hit an internal
  // assertion: the search's squares overflowed).
  EXPECT_EQ(
      gpipe::balance_cost({1e160, 1e160, 1e160, 1e160}, 2),
      (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(
      gpipe::balance_cost({1e308, 1e308, 1, 1}, 2),
      (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(
      gpipe::balance_cost({100e300, 1e300, 1e300, 1e300}, 2),
      (std::vector<int64_t>{1, 3}));
  EXPECT_THROW(gpipe::balance_cost({1, INFINITY}, 2), c10::ValueError);
}

// ---------------------------------------------------------------------------
// Balance by time.

TEST_F(BalanceTest, BalanceByTimeSplitsBySleepTime) {
  // 5, 10, ..., 30 ms: [4, 2] (50 and 55 ms) is the only balance whose
  // slowest partition is under 75 ms; the even split [3, 3] has 75 ms.
  // Timed for 1 s, the mean of about 8 passes: with 0.25 s, one pass could
  // be all that counted, and a sleep overslept by 20 ms on a loaded machine
  // chose [3, 3] (once, under ASan in CI).
  torch::nn::Sequential increasing;
  torch::nn::Sequential decreasing;
  for (int i = 1; i <= 6; ++i) {
    increasing->push_back(Sleep(5 * i));
    decreasing->push_back(PlainSleep(5 * (7 - i)));
  }
  const auto sample = torch::rand({1});
  EXPECT_EQ(
      gpipe::balance_by_time(2, increasing, sample, /*timeout=*/1.0),
      (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(
      gpipe::balance_by_time(2, decreasing, sample, /*timeout=*/1.0),
      (std::vector<int64_t>{2, 4}));
}

TEST_F(BalanceTest, ProfileTimesMeasuresEachLayer) {
  torch::nn::Sequential model(Sleep(2), Sleep(40), PlainSleep(2));
  const auto times = gpipe::profile_times(model, torch::rand({1}), 0);
  ASSERT_EQ(times.size(), 3u);
  EXPECT_GE(times[1], 0.040);
  EXPECT_GT(times[1], times[0]);
  EXPECT_GT(times[1], times[2]);
}

TEST_F(BalanceTest, ProfileTimesGivesOnePassNotTheTotal) {
  // About 12 passes fit in the timeout: one pass's 40 ms is returned, not
  // their sum.
  torch::nn::Sequential model(Sleep(2), Sleep(40));
  const auto times = gpipe::profile_times(model, torch::rand({1}), 0.5);
  ASSERT_EQ(times.size(), 2u);
  EXPECT_GE(times[1], 0.040);
  EXPECT_LT(times[1], 0.2);
}

TEST_F(BalanceTest, BalanceByTimeRestartsEveryPassFromTheSample) {
  // A second pass fed with the first pass's output would fail in the
  // convolution.
  torch::nn::Sequential model(
      torch::nn::Conv2d(3, 2, 1), Flatten(), torch::nn::Linear(128, 10));
  const auto balance = gpipe::balance_by_time(
      2, model, torch::rand({10, 3, 8, 8}), /*timeout=*/0.1);
  ASSERT_EQ(balance.size(), 2u);
  EXPECT_EQ(balance[0] + balance[1], 3);
}

TEST_F(BalanceTest, BalanceByTimeRunsTupleLayers) {
  // A layer returning a tuple of which one tensor does not require grad,
  // then a layer taking a tuple; and a tuple sample.
  torch::nn::Sequential model{Twin(), AddPair()};
  const auto sample = torch::rand({2, 3}, torch::requires_grad());
  EXPECT_EQ(
      gpipe::balance_by_time(1, model, sample, /*timeout=*/0.02),
      (std::vector<int64_t>{2}));
  EXPECT_EQ(
      gpipe::balance_by_size(1, model, sample), (std::vector<int64_t>{2}));

  torch::nn::Sequential pair(AddPair(), torch::nn::Linear(3, 3));
  const std::vector<torch::Tensor> tuple = {
      torch::rand({2, 3}), torch::rand({2, 3})};
  EXPECT_EQ(
      gpipe::balance_by_time(2, pair, tuple, /*timeout=*/0.02),
      (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(
      gpipe::balance_by_size(2, pair, tuple), (std::vector<int64_t>{1, 1}));
}

// ---------------------------------------------------------------------------
// Balance by size.

// [Linear, Linear, Repeat, Shrink, Linear] on (8, 16): Repeat keeps a
// (8, 1024) float activation, 32 KiB; a Linear(16, 16) keeps 512 bytes of
// output and 1088 bytes of parameters (x2); Shrink keeps 512 bytes.
torch::nn::Sequential big_activation_model() {
  return torch::nn::Sequential(
      torch::nn::Linear(16, 16),
      torch::nn::Linear(16, 16),
      Repeat(),
      Shrink(),
      torch::nn::Linear(16, 16));
}

TEST_F(BalanceTest, ProfileSizesCountsKeptActivationsAndParameters) {
  const auto input = torch::rand({8, 16});
  const auto sizes = gpipe::profile_sizes(big_activation_model(), input);
  ASSERT_EQ(sizes.size(), 5u);
  // Outputs are what the allocator sees; nothing else of size is kept.
  EXPECT_GE(sizes[0], 512 + 2 * 1088);
  EXPECT_LE(sizes[0], 512 + 2 * 1088 + 512);
  EXPECT_GE(sizes[2], 32768);
  EXPECT_LE(sizes[2], 32768 + 512);
  EXPECT_GE(sizes[3], 512);
  EXPECT_LE(sizes[3], 1024);

  // One micro-batch of ceil(8 / chunks) rows, scaled to 8 / chunks rows.
  const auto halves = gpipe::profile_sizes(
      big_activation_model(), input, /*chunks=*/2, /*param_scale=*/0);
  EXPECT_GE(halves[2], 16384);
  EXPECT_LE(halves[2], 16384 + 512);
  EXPECT_GE(halves[0], 256);
  EXPECT_LE(halves[0], 256 + 512);
  const auto thirds = gpipe::profile_sizes(
      big_activation_model(), input, /*chunks=*/3, /*param_scale=*/0);
  EXPECT_NEAR(thirds[2], 32768.0 / 3, 512);

  // The CPU allocator is LibTorch's again.
  const auto* before = c10::GetCPUAllocator();
  gpipe::profile_sizes(big_activation_model(), input);
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

TEST_F(BalanceTest, BalanceBySizeIsolatesTheBigActivation) {
  EXPECT_EQ(
      gpipe::balance_by_size(3, big_activation_model(), torch::rand({8, 16})),
      (std::vector<int64_t>{2, 1, 2}));
}

TEST_F(BalanceTest, BalanceBySizeWeighsParametersByParamScale) {
  // A Linear(128, 128) has 66 KB of parameters and, at batch 4, keeps 2 KiB
  // of output as each of the three parameterless layers after it.
  auto model = [] {
    return torch::nn::Sequential(
        torch::nn::Linear(128, 128),
        torch::nn::Functional([](torch::Tensor x) { return x * 2; }),
        torch::nn::Functional([](torch::Tensor x) { return x * 2; }),
        torch::nn::Functional([](torch::Tensor x) { return x * 2; }));
  };
  const auto input = torch::rand({4, 128});
  EXPECT_EQ(
      gpipe::balance_by_size(2, model(), input, 1, /*param_scale=*/0),
      (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(
      gpipe::balance_by_size(2, model(), input, 1, /*param_scale=*/2),
      (std::vector<int64_t>{1, 3}));
}

TEST_F(BalanceTest, BalanceBySizeSupportsTheRawAllocatorInterface) {
  torch::nn::Sequential model(RawScratch(), torch::nn::Linear(4, 4));
  EXPECT_EQ(
      gpipe::balance_by_size(2, model, torch::rand({2, 4})),
      (std::vector<int64_t>{1, 1}));
}

// ---------------------------------------------------------------------------
// Skips.

TEST_F(BalanceTest, BalanceByTimeRunsSkipLayers) {
  // As BalanceByTimeSplitsBySleepTime, with a skip from layer 1 to layer 4
  // and a sample that requires grad, so that backward runs through both
  // (timed for 1 s, as that test is).
  torch::nn::Sequential model(
      Sleep(5), StashSleep(10), Sleep(15), Sleep(20), PopSleep(25), Sleep(30));
  gpipe::verify_skippables(model);
  const auto sample = torch::rand({2, 3}, torch::requires_grad());
  EXPECT_EQ(
      gpipe::balance_by_time(2, model, sample, /*timeout=*/1.0),
      (std::vector<int64_t>{4, 2}));
  EXPECT_FALSE(sample.grad().defined());
}

TEST_F(BalanceTest, BalanceBySizeCountsStashedTensorsOnTheStashingLayer) {
  // As big_activation_model, but the big tensor is stashed by layer 2 and
  // popped by layer 3.
  torch::nn::Sequential model(
      torch::nn::Linear(16, 16),
      torch::nn::Linear(16, 16),
      StashBig(),
      PopShrink(),
      torch::nn::Linear(16, 16));
  const auto input = torch::rand({8, 16});
  const auto sizes = gpipe::profile_sizes(model, input);
  EXPECT_GE(sizes[2], 32768 + 512);
  EXPECT_LE(sizes[2], 32768 + 1024);
  EXPECT_LE(sizes[3], 2048);
  EXPECT_EQ(
      gpipe::balance_by_size(3, model, input), (std::vector<int64_t>{2, 1, 2}));
}

// ---------------------------------------------------------------------------
// The original module.

struct Snapshot {
  std::vector<torch::Tensor> values;
  std::vector<torch::Tensor> grads;
  std::vector<const void*> grad_data;
  std::vector<int64_t> versions;
  std::vector<torch::Tensor> buffers;
  std::vector<bool> training;

  explicit Snapshot(const torch::nn::Module& model) {
    for (const auto& p : model.parameters()) {
      values.push_back(p.detach().clone());
      grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
      grad_data.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
      versions.push_back(p._version());
    }
    for (const auto& b : model.buffers()) {
      buffers.push_back(b.clone());
    }
    for (const auto& m : model.modules()) {
      training.push_back(m->is_training());
    }
  }
};

void expect_same(const torch::nn::Module& model, const Snapshot& before) {
  const auto params = model.parameters();
  ASSERT_EQ(params.size(), before.values.size());
  for (const auto i : c10::irange(params.size())) {
    EXPECT_TRUE(params[i].equal(before.values[i])) << "parameter " << i;
    ASSERT_EQ(params[i].grad().defined(), before.grads[i].defined())
        << "gradient " << i;
    if (before.grads[i].defined()) {
      EXPECT_TRUE(params[i].grad().equal(before.grads[i])) << "gradient " << i;
      EXPECT_EQ(params[i].grad().data_ptr(), before.grad_data[i])
          << "gradient " << i;
    }
  }
  const auto buffers = model.buffers();
  ASSERT_EQ(buffers.size(), before.buffers.size());
  for (const auto i : c10::irange(buffers.size())) {
    EXPECT_TRUE(buffers[i].equal(before.buffers[i])) << "buffer " << i;
  }
  const auto modules = model.modules();
  ASSERT_EQ(modules.size(), before.training.size());
  for (const auto i : c10::irange(modules.size())) {
    EXPECT_EQ(modules[i]->is_training(), before.training[i])
        << "module " << i << " (" << modules[i]->name() << ")";
  }
}

TEST_F(BalanceTest, ProfilingLeavesTheModuleAsItWas) {
  auto seen = std::make_shared<std::vector<bool>>();
  ScaleNorm scale_norm(8);
  Drift drift(8);
  // Neither clones: they are profiled in place and put back.
  EXPECT_THROW(scale_norm->clone(), c10::Error);
  EXPECT_THROW(drift->clone(), c10::Error);
  torch::nn::Sequential model(
      torch::nn::Linear(4, 8),
      torch::nn::BatchNorm1d(8),
      scale_norm,
      drift,
      torch::nn::Dropout(0.5),
      TrainingProbe(seen),
      torch::nn::Linear(8, 2));

  // Gradients on every parameter but two, running statistics that moved,
  // and modes that differ between layers.
  model->forward(torch::rand({6, 4})).sum().backward();
  model->ptr(0)->named_parameters()["bias"].mutable_grad() = torch::Tensor();
  scale_norm->scale.mutable_grad() = torch::Tensor();
  model->eval();
  model->ptr(1)->train();
  scale_norm->norm->train();
  seen->clear();

  const Snapshot before(*model);
  const auto sample = torch::rand({6, 4}, torch::requires_grad());

  const auto by_time = gpipe::balance_by_time(3, model, sample, 0.05);
  EXPECT_EQ(by_time.size(), 3u);
  expect_same(*model, before);
  const auto by_size = gpipe::balance_by_size(3, model, sample, 2);
  EXPECT_EQ(by_size.size(), 3u);
  expect_same(*model, before);

  // Parameters were not written to, but for Drift's, which its own forward
  // changes (and profiling puts back).
  const auto params = model->parameters();
  for (const auto i : c10::irange(params.size())) {
    if (!params[i].is_same(drift->weight)) {
      EXPECT_EQ(params[i]._version(), before.versions[i]) << "parameter " << i;
    }
  }
  EXPECT_FALSE(sample.grad().defined());
  ASSERT_FALSE(seen->empty());
  for (const bool training : *seen) {
    EXPECT_TRUE(training);
  }
}

TEST_F(BalanceTest, ProfilingLeavesTheRandomNumbersAlone) {
  // Linear's clone() draws new initial values; Dropout draws masks.
  torch::nn::Sequential model(
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5),
      torch::nn::Linear(4, 4));
  const auto sample = torch::rand({2, 4});
  torch::manual_seed(7);
  const auto expected = torch::rand({8});
  torch::manual_seed(7);
  gpipe::balance_by_time(2, model, sample, 0);
  gpipe::balance_by_size(2, model, sample);
  EXPECT_TRUE(torch::rand({8}).equal(expected));
}

TEST_F(BalanceTest, WhatAnotherThreadDrawsWhileBalancingStaysDrawn) {
  // Balancing put the default generator back where it stood, so the numbers
  // another thread drew meanwhile came round again (686 draws, 420
  // distinct, measured from outside). Layers that draw nothing, so that the
  // other thread's draws are the first after the state that came back.
  torch::nn::Sequential model{torch::nn::ReLU(), torch::nn::Tanh()};
  const auto sample = torch::rand({16, 64});
  std::atomic<bool> done{false};
  std::atomic<bool> started{false};
  std::vector<int64_t> drawn;
  std::thread other([&] {
    while (!done.load()) {
      drawn.push_back(torch::randint(0, int64_t{1} << 62, {1}).item<int64_t>());
      started.store(true);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  while (!started.load()) {
    std::this_thread::yield();
  }
  gpipe::balance_by_time(2, model, sample, 0.2);
  gpipe::balance_by_size(2, model, sample);
  done.store(true);
  other.join();
  // Then more draws: none of them may repeat one made during balancing.
  for (int k = 0; k < 200; ++k) {
    drawn.push_back(torch::randint(0, int64_t{1} << 62, {1}).item<int64_t>());
  }
  auto sorted = drawn;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end())
      << "a number was drawn twice among " << drawn.size();
}

TEST_F(BalanceTest, ProfilingOnTheCpuLeavesTheDefaultGeneratorStill) {
  // Profiling set the default generator aside (reseeded it) and drew its
  // masks and initial values from it, so a pipeline training on another
  // thread saw it move under a checkpointed cell's recomputation and
  // failed: 'drew random numbers although its forward drew none' (82 of
  // 1,043 steps, measured from outside). Now the profiling thread draws
  // from a generator of its own: the default one stands still throughout,
  // as every layer of the profiled model sees it.
  torch::Tensor state;  // once the model and sample are made
  std::atomic<int64_t> checked{0};
  std::atomic<int64_t> moved{0};
  auto watch = gpipe::testing::lambda([&](torch::Tensor x) {
    ++checked;
    if (!at::detail::getDefaultCPUGenerator().get_state().equal(state)) {
      ++moved;
    }
    return x;
  });
  torch::nn::Sequential model(
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5),
      watch,
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5));
  const auto sample = torch::rand({4, 4});
  state = at::detail::getDefaultCPUGenerator().get_state();
  gpipe::balance_by_time(2, model, sample, 0);
  gpipe::balance_by_size(2, model, sample);
  EXPECT_GT(checked.load(), 0);
  EXPECT_EQ(moved.load(), 0) << "of " << checked.load();
  EXPECT_TRUE(at::detail::getDefaultCPUGenerator().get_state().equal(state));
  // autotune too, with the threads that load the other lanes while it
  // times one (they drew their masks from the default generator). They
  // train copies, so the model clones: no watching layer.
  torch::nn::Sequential cloneable(
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5),
      torch::nn::Linear(4, 4),
      torch::nn::Dropout(0.5));
  const auto target = torch::rand({4, 4});
  state = at::detail::getDefaultCPUGenerator().get_state();
  gpipe::autotune(
      cloneable,
      sample,
      target,
      [](torch::Tensor y, torch::Tensor t) { return torch::mse_loss(y, t); },
      gpipe::AutotuneOptions(2).profile_seconds(0.05).threads_per_lane(1));
  EXPECT_TRUE(at::detail::getDefaultCPUGenerator().get_state().equal(state));
}

TEST_F(BalanceTest, OverlappingProfilesPutTheUsersStreamBack) {
  // Each profile set the generator aside and put back what it had found:
  // one that began inside another's and ended after it put back the other's
  // aside stream, and the user's seeded stream was lost.
  torch::nn::Sequential model{torch::nn::ReLU(), torch::nn::Tanh()};
  const auto sample = torch::rand({4, 4});
  torch::manual_seed(7);
  const auto expected = torch::rand({8});
  torch::manual_seed(7);
  std::thread first([&] { gpipe::balance_by_time(2, model, sample, 0.1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  std::thread second([&] { gpipe::balance_by_time(2, model, sample, 0.3); });
  first.join();
  second.join();
  EXPECT_TRUE(torch::rand({8}).equal(expected));
}

TEST_F(BalanceTest, ProfilingInsideACellIsRefusedNotAHang) {
  // Inside a cell (which holds the lease on the generators), profiling
  // waited for the lease it held.
  struct ProfilingImpl : torch::nn::Module {
    torch::Tensor forward(torch::Tensor x) {
      torch::nn::Sequential inner{torch::nn::ReLU(), torch::nn::Tanh()};
      gpipe::balance_by_time(2, inner, x.detach(), 0);
      return x;
    }
  };
  torch::nn::Sequential net(
      torch::nn::Linear(4, 4), std::make_shared<ProfilingImpl>());
  gpipe::GPipe model(net, gpipe::GPipeOptions({1, 1}).chunks(2));
  try {
    model->forward(torch::rand({4, 4}));
    ADD_FAILURE() << "profiling inside a cell ran";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("cannot run inside a pipeline's cell"),
        std::string::npos)
        << e.what();
  }
  // Again (the lease was let go): the same refusal, not a hang.
  EXPECT_THROW(model->forward(torch::rand({4, 4})), c10::Error);
}

TEST_F(BalanceTest, InPlaceLayersAreProfiledAndTheSampleIsLeftAlone) {
  // An in-place first layer wrote into the caller's sample (balance_by_size
  // into its first micro-batch's rows), and every in-place layer after the
  // first was refused ("a leaf Variable that requires grad is being used in
  // an in-place operation"), though GPipe runs such a model.
  torch::nn::Sequential model(
      torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
      torch::nn::Linear(10, 10),
      torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
      torch::nn::Linear(10, 10));
  const auto sample = torch::randn({8, 10});
  const auto before = sample.clone();
  EXPECT_EQ(gpipe::balance_by_time(2, model, sample, 0.05).size(), 2u);
  EXPECT_TRUE(sample.equal(before));
  EXPECT_EQ(gpipe::balance_by_size(2, model, sample, 2).size(), 2u);
  EXPECT_TRUE(sample.equal(before));
  const auto times = gpipe::profile_times(model, sample, 0.05);
  EXPECT_EQ(times.size(), 4u);
  EXPECT_TRUE(sample.equal(before));
}

TEST_F(BalanceTest, DevicesItCannotUseAreNamed) {
  torch::nn::Sequential model(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2));
  const auto sample = torch::rand({4, 2});
  expect_value_error(
      [&] {
        gpipe::balance_by_time(2, model, sample, 0, torch::Device("meta"));
      },
      "device must be the CPU or a CUDA device, but got meta");
  if (!torch::cuda::is_available()) {
    expect_value_error(
        [&] { gpipe::balance_by_time(2, model, sample, 0, torch::kCUDA); },
        "this LibTorch has no CUDA: device is cuda");
  }
}

TEST_F(BalanceTest, NonCloneableLayersAreBalanced) {
  torch::nn::Sequential model(
      PlainSleep(2), PlainSleep(2), ScaleNorm(3), PlainSleep(40));
  EXPECT_EQ(
      gpipe::balance_by_time(2, model, torch::rand({4, 3}), 0.1),
      (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(
      gpipe::balance_by_size(4, model, torch::rand({4, 3})),
      (std::vector<int64_t>{1, 1, 1, 1}));
}

// ---------------------------------------------------------------------------
// Errors.

TEST_F(BalanceTest, BalancersRejectBadArguments) {
  torch::nn::Sequential model(
      torch::nn::Linear(2, 2), torch::nn::ReLU(), torch::nn::Linear(2, 2));
  const auto sample = torch::rand({4, 2});
  expect_value_error(
      [&] { gpipe::balance_by_time(0, model, sample); },
      "partitions must be a positive integer, but got 0");
  expect_value_error(
      [&] { gpipe::balance_by_size(-2, model, sample); },
      "partitions must be a positive integer, but got -2");
  expect_value_error(
      [&] { gpipe::balance_by_time(4, model, sample); },
      "expected at most 3 partitions for a module of 3 layers, but got 4");
  expect_value_error(
      [&] { gpipe::balance_by_size(4, model, sample); },
      "expected at most 3 partitions for a module of 3 layers, but got 4");
  expect_value_error(
      [&] { gpipe::balance_by_time(1, torch::nn::Sequential(), sample); },
      "expected a torch::nn::Sequential with at least one layer, but got an "
      "empty one");
  expect_value_error(
      [&] { gpipe::profile_sizes(torch::nn::Sequential(), sample); },
      "but got an empty one");
  expect_value_error(
      [&] { gpipe::balance_by_time(1, model, torch::Tensor()); },
      "tensor 0 is undefined");
  expect_value_error(
      [&] {
        gpipe::balance_by_size(1, model, torch::rand({0, 2}));
      },
      "tensor 0 has shape [0, 2]");
  expect_value_error(
      [&] { gpipe::balance_by_time(1, model, std::vector<torch::Tensor>{}); },
      "sample must hold at least one tensor, but got an empty list");
  expect_value_error(
      [&] { gpipe::balance_by_time(1, model, sample, -1.0); },
      "timeout must be a non-negative number of seconds, but got -1");
  expect_value_error(
      [&] { gpipe::balance_by_size(1, model, sample, 0); },
      "chunks must be a positive integer, but got 0");
  expect_value_error(
      [&] { gpipe::balance_by_size(1, model, sample, 1, -1.0); },
      "param_scale must be a finite non-negative number, but got -1");
  expect_value_error(
      [&] { gpipe::balance_by_size(1, model, torch::tensor(1.0)); },
      "input must have a batch dimension (dim 0), but tensor 0 is a scalar");
  expect_value_error(
      [&] {
        gpipe::balance_by_size(
            1, model, sample, 1, 2.0, torch::Device(torch::kCUDA, 0));
      },
      "sizes are profiled on CPU (by counting LibTorch's CPU allocations), "
      "so device must be CPU, but got cuda:0");
}

TEST_F(BalanceTest, LayerErrorsNameTheLayer) {
  torch::nn::Sequential model(torch::nn::Linear(2, 2), torch::nn::Linear(3, 3));
  try {
    gpipe::balance_by_time(2, model, torch::rand({4, 2}), 0);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "while profiling the time of layer 1 ('1') on an input of shape "
            "[4, 2]"),
        std::string::npos)
        << e.what();
  }
  try {
    gpipe::balance_by_size(2, model, torch::rand({4, 2}));
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "while profiling the size of layer 1 ('1') on an input of shape "
            "[4, 2]"),
        std::string::npos)
        << e.what();
  }
  // The allocator went back although the profile failed.
  const auto* before = c10::GetCPUAllocator();
  EXPECT_THROW(gpipe::profile_sizes(model, torch::rand({4, 2})), c10::Error);
  EXPECT_EQ(c10::GetCPUAllocator(), before);
}

}  // namespace
