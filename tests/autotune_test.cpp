// autotune: the fastest candidate that fits the memory limit, what it
// rejected and why, options that build a pipeline which trains as the
// plain model does, and clear errors.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "balance/autotune_text.h"
#include "common.h"
#include "device.h"

namespace gpipe {
namespace {

using testing::PopAdd;
using testing::SeededTest;
using testing::TanhStash;

class AutotuneTest : public SeededTest {};

// 8 layers, a wide middle (most of the memory and the time) and a skip
// from layer 1 to layer 6.
torch::nn::Sequential model() {
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(32, 64));
  net->push_back(TanhStash());
  net->push_back(torch::nn::Linear(64, 512));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(512, 64));
  net->push_back(torch::nn::Tanh());
  net->push_back(PopAdd());
  net->push_back(torch::nn::Linear(64, 10));
  return net;
}

torch::Tensor loss_of(torch::Tensor y, torch::Tensor t) {
  return torch::nn::functional::cross_entropy(y, t);
}

double most(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

AutotuneOptions quick(int64_t lanes) {
  return AutotuneOptions(lanes).profile_seconds(0.02).threads_per_lane(1);
}

TEST_F(AutotuneTest, PicksTheFastestThatFitsAndSaysWhatItRejected) {
  auto net = model();
  auto x = torch::randn({64, 32});
  auto y = torch::randint(0, 10, {64});
  const auto free = autotune(net, x, y, loss_of, quick(2));
  ASSERT_FALSE(free.candidates.empty());
  EXPECT_DOUBLE_EQ(
      free.predicted_step_seconds,
      free.candidates.front().predicted_step_seconds);
  EXPECT_EQ(free.predicted_peak_bytes.size(), 2u);
  for (const auto& c : free.candidates) {
    EXPECT_TRUE(c.rejected.empty());
  }
  // A limit below the unconstrained choice's peak and halfway down the
  // candidates' range at most: something else, that fits, and the faster
  // ones rejected with the lane and the numbers. (The two runs time the
  // layers apart: their balances by time, and so some candidates' peaks,
  // may differ. Just below the first choice's peak, the second run once
  // had no candidate over it; halfway, the unbalanced and uncheckpointed
  // ones are far over it in any run, and the checkpointed ones far under.)
  double low = most(free.candidates.front().predicted_peak_bytes);
  double high = low;
  for (const auto& c : free.candidates) {
    low = std::min(low, most(c.predicted_peak_bytes));
    high = std::max(high, most(c.predicted_peak_bytes));
  }
  ASSERT_GT(high, 2 * low) << "the candidates' peaks span too little";
  const auto limit = std::min(
      static_cast<int64_t>(most(free.predicted_peak_bytes)) - 1,
      static_cast<int64_t>((low + high) / 2));
  const auto tight = autotune(net, x, y, loss_of, quick(2).memory_limit(limit));
  EXPECT_LE(most(tight.predicted_peak_bytes), static_cast<double>(limit));
  size_t rejected = 0;
  for (const auto& c : tight.candidates) {
    if (c.predicted_step_seconds < tight.predicted_step_seconds) {
      EXPECT_FALSE(c.rejected.empty());
    }
    if (!c.rejected.empty()) {
      ++rejected;
      EXPECT_NE(c.rejected.find("over the limit of"), std::string::npos)
          << c.rejected;
      EXPECT_GT(most(c.predicted_peak_bytes), static_cast<double>(limit));
    }
  }
  EXPECT_GT(rejected, 0u);
  const auto report = tight.report();
  EXPECT_NE(report.find("over the limit of"), std::string::npos) << report;
  EXPECT_NE(report.find("fits"), std::string::npos) << report;
  std::ostringstream line;
  line << tight;
  EXPECT_NE(line.str().find("predicted"), std::string::npos);
  EXPECT_NE(line.str().find(to_string(tight.schedule)), std::string::npos);
}

// A balance of 13 partitions (29 characters) ran into the next column of
// the report: '[1,1,1,1,1,1,1,1,1,1,1,1,1]1'.
TEST_F(AutotuneTest, TheReportKeepsItsColumnsApartForLongBalances) {
  torch::nn::Sequential net;
  for (int k = 0; k < 13; ++k) {
    net->push_back(torch::nn::Linear(4, 4));
  }
  const auto tuned = autotune(
      net,
      torch::randn({4, 4}),
      torch::randn({4, 4}),
      [](torch::Tensor y, torch::Tensor t) { return torch::mse_loss(y, t); },
      quick(13).chunks({1}));
  const auto report = tuned.report();
  std::istringstream lines(report);
  std::string line;
  std::getline(lines, line);  // the choice
  std::getline(lines, line);  // the header
  const auto threads_at = line.find("threads");
  int rows = 0;
  while (std::getline(lines, line)) {
    const auto end = line.find(']');
    if (end == std::string::npos) {
      continue;  // the count
    }
    ++rows;
    EXPECT_LT(end + 2, threads_at) << report;
    EXPECT_EQ(line.find_first_not_of(' ', end + 1), threads_at) << report;
  }
  EXPECT_GT(rows, 0) << report;
}

// Predicted times past 9.2e12 s (a cell cost given far too large): the
// candidates were ordered by whole microseconds in a long long, which
// overflowed, and a slower one was chosen.
TEST_F(AutotuneTest, HugePredictedTimesAreOrderedAsAnyOther) {
  auto net = model();
  auto x = torch::randn({16, 32});
  auto y = torch::randint(0, 10, {16});
  const auto tuned = autotune(
      net, x, y, loss_of, quick(2).chunks({1, 4}).cell_overhead_seconds(1e12));
  ASSERT_FALSE(tuned.candidates.empty());
  for (const auto& c : tuned.candidates) {
    EXPECT_GE(c.predicted_step_seconds, tuned.predicted_step_seconds)
        << to_string(c.schedule) << " at chunks " << c.chunks;
  }
  EXPECT_EQ(tuned.chunks, 1);
}

TEST_F(AutotuneTest, ItsOptionsTrainAsThePlainModel) {
  auto net = model();
  net->to(torch::kFloat64);
  auto x = torch::randn({16, 32}, torch::kFloat64);
  auto y = torch::randint(0, 10, {16});
  const auto before = testing::copy_of(net);
  const auto tuned = autotune(
      net,
      x,
      y,
      loss_of,
      quick(2).schedules({Schedule::ZeroBubbleV, Schedule::OneFOneB}));
  // The model is not changed by profiling, nor are its gradients.
  const auto p1 = before->parameters();
  const auto p2 = net->parameters();
  ASSERT_EQ(p1.size(), p2.size());
  for (const auto k : c10::irange(p1.size())) {
    EXPECT_TRUE(p1[k].equal(p2[k])) << "parameter " << k;
    EXPECT_FALSE(p2[k].grad().defined()) << "parameter " << k;
  }
  auto copy = testing::copy_of(net);
  GPipe model(copy, tuned.options());
  EXPECT_EQ(model->placement(), tuned.placement);
  EXPECT_EQ(model->chunks(), tuned.chunks);
  auto expected = loss_of(net->forward(x), y);
  expected.backward();
  auto got = model->train_step(x, y, loss_of, tuned.plan);
  EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12);
  testing::expect_same_gradients(*net, *copy);
  // The schedule gives the same plan.
  EXPECT_EQ(
      make_plan(tuned.schedule, tuned.chunks, tuned.placement).to_csv(),
      tuned.plan.to_csv());
}

// A layer whose forward sleeps 12 ms over the calling thread's intra-op
// threads: it gains from more cores as a wide layer does, however loaded
// the machine is.
// It also draws a random number: with `draws` 1 through the random
// operators (as dropout does), with 2 from the default generator by name.
struct SleepOverThreadsImpl : torch::nn::Cloneable<SleepOverThreadsImpl> {
  explicit SleepOverThreadsImpl(int draws = 0) : draws(draws) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(
        std::chrono::microseconds(12000 / std::max(1, at::get_num_threads())));
    if (draws == 0) {
      return x * 1.0;
    }
    return x * (draws == 1
                    ? torch::rand({1})
                    : torch::rand({1}, at::detail::getDefaultCPUGenerator()));
  }
  int draws;
};
TORCH_MODULE(SleepOverThreads);

// With threads_per_lane 0 the planner chooses the threads: each plan is
// weighed as GPipe runs it by default (a plan whose lanes never work at
// once, chunks 1, with every core per cell; one whose lanes overlap with
// every core for its long cells that run alone) and with the lanes' own
// count fixed.
TEST_F(AutotuneTest, WeighsSharedThreadsAsTheEngineRunsThem) {
  const int64_t cores = detail::available_cores();
  if (cores < 2) {
    // Skipped: needs 2 cores: one-core machines, scripts/tsan.sh
    GTEST_SKIP()  // needs 2 cores: one-core machines, scripts/tsan.sh
        << "one core (or OMP_NUM_THREADS=1): nothing to share";
  }
  const int64_t own = std::max<int64_t>(1, cores / 2);
  torch::nn::Sequential net;
  for (int k = 0; k < 4; ++k) {
    net->push_back(torch::nn::Linear(16, 16));
    net->push_back(SleepOverThreads());
  }
  auto x = torch::randn({16, 16});
  auto y = torch::randint(0, 10, {16});
  const auto options = AutotuneOptions(2)
                           .profile_seconds(0.05)
                           .schedules({Schedule::FillDrain, Schedule::OneFOneB})
                           .chunks({1, 4})
                           .checkpoints({Checkpoint::Never});
  const auto tuned = autotune(net, x, y, loss_of, options);
  // (schedule, chunks, balance) -> predicted seconds by threads_per_lane.
  std::map<std::string, std::map<int64_t, double>> seen;
  for (const auto& c : tuned.candidates) {
    std::ostringstream key;
    key << to_string(c.schedule) << " " << c.chunks << " [";
    for (const auto b : c.balance) {
      key << b << ",";
    }
    key << "]";
    EXPECT_TRUE(c.threads_per_lane == 0 || c.threads_per_lane == own)
        << key.str() << ": " << c.threads_per_lane;
    EXPECT_TRUE(seen[key.str()]
                    .emplace(c.threads_per_lane, c.predicted_step_seconds)
                    .second)
        << key.str();
  }
  ASSERT_FALSE(seen.empty());
  for (const auto& [key, by_threads] : seen) {
    // Both ways; these layers gain from every core (a forward at `own`
    // threads sleeps 12 ms / own, at every core 12 ms / cores): at chunks 1
    // every cell, at chunks 4 the fill and the drain, whose cells are long
    // enough to run wide (Note [Wide cells on the calling thread]).
    ASSERT_EQ(by_threads.size(), 2u) << key;
    EXPECT_LT(by_threads.at(0), by_threads.at(own)) << key;
  }
  EXPECT_EQ(tuned.options().threads_per_lane(), tuned.threads_per_lane);
  EXPECT_NE(tuned.report().find("threads"), std::string::npos);
  // The choice builds a pipeline that shares the cores as simulated.
  GPipe model(testing::copy_of(net), tuned.options());
  EXPECT_EQ(model->threads_follow_plan(), tuned.threads_per_lane == 0);

  // A count given is kept by every candidate.
  const auto fixed = autotune(
      net, x, y, loss_of, AutotuneOptions(options).threads_per_lane(1));
  for (const auto& c : fixed.candidates) {
    EXPECT_EQ(c.threads_per_lane, 1);
  }
  EXPECT_EQ(fixed.threads_per_lane, 1);
  EXPECT_EQ(fixed.options().threads_per_lane(), 1);

  // Cells far shorter than kWideCellSeconds stay on their lanes where the
  // lanes overlap: at chunks 4 both ways predict the same step.
  torch::nn::Sequential quick;
  for (int k = 0; k < 4; ++k) {
    quick->push_back(torch::nn::Linear(16, 16));
  }
  const auto short_cells =
      autotune(quick, x, y, loss_of, AutotuneOptions(options).chunks({4}));
  std::map<std::string, std::map<int64_t, double>> quick_seen;
  for (const auto& c : short_cells.candidates) {
    std::ostringstream key;
    key << to_string(c.schedule) << " [";
    for (const auto b : c.balance) {
      key << b << ",";
    }
    key << "]";
    quick_seen[key.str()][c.threads_per_lane] = c.predicted_step_seconds;
  }
  ASSERT_FALSE(quick_seen.empty());
  for (const auto& [key, by_threads] : quick_seen) {
    ASSERT_EQ(by_threads.size(), 2u) << key;
    EXPECT_DOUBLE_EQ(by_threads.at(0), by_threads.at(own)) << key;
  }
}

// On CPU lanes a cell that draws from the default generator by name holds
// it alone (Note [Random streams of concurrent cells]), so the planner
// predicts such forwards one at a time; one that draws through the random
// operators has a generator of its own and runs beside the others.
TEST_F(AutotuneTest, ForwardsThatDrawByNameArePredictedOneAtATime) {
  const auto predicted = [](int draws) {
    torch::nn::Sequential net;
    for (int k = 0; k < 4; ++k) {
      net->push_back(torch::nn::Linear(16, 16));
      net->push_back(SleepOverThreads(draws));
    }
    const auto tuned = autotune(
        net,
        torch::randn({16, 16}),
        torch::randint(0, 10, {16}),
        loss_of,
        AutotuneOptions(2)
            .threads_per_lane(1)
            .profile_seconds(0.05)
            .schedules({Schedule::FillDrain})
            .chunks({4})
            .checkpoints({Checkpoint::Never}));
    // Two sleeping layers on each stage: [4, 4], or [5, 3] (the fifth
    // layer, a Linear, weighs next to nothing, so timing may put it
    // either side).
    EXPECT_TRUE(
        tuned.balance == (std::vector<int64_t>{4, 4}) ||
        tuned.balance == (std::vector<int64_t>{5, 3}))
        << tuned.balance;
    return tuned.predicted_step_seconds;
  };
  // Forwards of 24 ms a stage: 5 of them in a row when the lanes overlap,
  // 8 when they run one at a time.
  const double none = predicted(0);
  const double own = predicted(1);
  const double by_name = predicted(2);
  EXPECT_LT(own, none * 1.15) << none << " " << own;
  EXPECT_GT(by_name, none * 1.3) << none << " " << by_name;
}

TEST_F(AutotuneTest, AMemoryLimitNothingFitsIsAClearError) {
  auto net = model();
  auto x = torch::randn({8, 32});
  auto y = torch::randint(0, 10, {8});
  try {
    autotune(net, x, y, loss_of, quick(2).memory_limit(1));
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(
        what.find("no candidate fits the memory limit"), std::string::npos)
        << what;
    EXPECT_NE(what.find("the smallest peak found is"), std::string::npos)
        << what;
  }
  // A limit a byte below the smallest peak: both in bytes too, where the
  // rounded figures read alike (it said '9.2 KiB per lane; the smallest
  // peak found is 9.2 KiB').
  EXPECT_EQ(
      detail::limit_and_peak_text(9471, 9472.0),
      std::make_pair(
          std::string("9.2 KiB (9471 bytes)"),
          std::string("9.2 KiB (9472 bytes)")));
  EXPECT_EQ(
      detail::limit_and_peak_text(9471, 20000.0),
      std::make_pair(std::string("9.2 KiB"), std::string("19.5 KiB")));
}

TEST_F(AutotuneTest, BadOptionsAreRefused) {
  auto net = model();
  auto x = torch::randn({8, 32});
  auto y = torch::randint(0, 10, {8});
  auto error_of = [&](const AutotuneOptions& o) -> std::string {
    try {
      autotune(net, x, y, loss_of, o);
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(
      error_of(quick(0)).find("expected lanes between 1 and the model's 8"),
      std::string::npos);
  EXPECT_NE(error_of(quick(9)).find("but got 9"), std::string::npos);
  EXPECT_NE(
      error_of(quick(2).memory_limit(-1)).find("memory_limit >= 0"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).chunks({})).find("at least one schedule"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).chunks({0})).find("chunks >= 1"), std::string::npos);
  // A batch larger than the sample: a micro-batch would need more rows.
  EXPECT_NE(
      error_of(quick(2).batch_size(64).chunks({4}))
          .find("a micro-batch of 16 rows"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).batch_size(-4)).find("batch_size >= 0 rows"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).profile_seconds(-1)).find("profile_seconds >= 0"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).profile_seconds(std::nan("")))
          .find("profile_seconds >= 0"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).cell_overhead_seconds(-1))
          .find("cell_overhead_seconds >= 0"),
      std::string::npos);
  // Infinity is >= 0: the message asks for a finite value.
  const auto inf = std::numeric_limits<double>::infinity();
  EXPECT_NE(
      error_of(quick(2).cell_overhead_seconds(inf))
          .find("expected a finite cell_overhead_seconds >= 0, but got inf"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).profile_seconds(inf))
          .find("expected a finite profile_seconds >= 0"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).param_scale(inf))
          .find("expected a finite param_scale >= 0, but got inf"),
      std::string::npos);
  // An empty sample is named as such (it has as many rows as its target).
  try {
    autotune(net, x.narrow(0, 0, 0), y.narrow(0, 0, 0), loss_of, quick(2));
    ADD_FAILURE() << "an empty sample was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("expected a sample input with at least one row in "
                  "dimension 0, but got shape [0, 32]"),
        std::string::npos)
        << e.what_without_backtrace();
  }
  // Thousands of threads a lane took minutes and gigabytes to refuse; a
  // checkpoint mode that is none was taken, and printing the choice failed.
  EXPECT_NE(
      error_of(quick(2).threads_per_lane(2000)).find("1 to 1024, but got 2000"),
      std::string::npos);
  EXPECT_NE(
      error_of(quick(2).checkpoints({static_cast<Checkpoint>(99)}))
          .find("checkpoint modes Always, ExceptLast or Never to try, but got "
                "99"),
      std::string::npos);
  try {
    autotune(net, x, y, LossFunction(), quick(2));
    ADD_FAILURE() << "no error for an empty loss_fn";
  } catch (const c10::TypeError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace()).find("expected a loss_fn"),
        std::string::npos);
  }
  // A limit below a KiB, in bytes.
  EXPECT_NE(
      error_of(quick(2).memory_limit(10)).find("memory limit of 10 bytes"),
      std::string::npos);
  // No candidate: the message gives the reason that holds (it gave both
  // as "or").
  const auto above = error_of(quick(2).chunks({32}));
  EXPECT_NE(above.find("above the batch size 8"), std::string::npos) << above;
  EXPECT_EQ(above.find("more stages"), std::string::npos) << above;
  const auto stages = error_of(
      quick(8).schedules({gpipe::Schedule::Interleaved1F1B}).chunks({2}));
  EXPECT_NE(
      stages.find("needs more stages than the model's 8 layers"),
      std::string::npos)
      << stages;
  EXPECT_EQ(stages.find("batch size"), std::string::npos) << stages;
  // Every parameter frozen: a choice train_step would refuse (it was
  // returned, and the first step refused it).
  {
    auto frozen = model();
    for (auto& p : frozen->parameters()) {
      p.requires_grad_(false);
    }
    try {
      autotune(frozen, x, y, loss_of, quick(2));
      ADD_FAILURE() << "no error for a model with every parameter frozen";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(
          std::string(e.what_without_backtrace())
              .find("every parameter is frozen"),
          std::string::npos)
          << e.what_without_backtrace();
    }
  }
  try {
    autotune(net, x, y.narrow(0, 0, 4), loss_of, quick(2));
    ADD_FAILURE() << "no error for 8 inputs and 4 targets";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace()).find("the same rows"),
        std::string::npos);
  }
}

// A loss function that throws, or returns nothing, is a c10::Error that
// says where: every error of the library is one.
TEST_F(AutotuneTest, LossErrorsNameTheLossAndAreC10Errors) {
  auto net = model();
  auto x = torch::randn({8, 32});
  auto y = torch::randint(0, 10, {8});
  const auto error_of = [&](const LossFunction& loss) -> std::string {
    try {
      autotune(net, x, y, loss, quick(2).chunks({2}));
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    } catch (const std::exception& e) {
      return std::string("not a c10::Error: ") + e.what();
    }
    return "no error";
  };
  const auto thrown =
      error_of([](torch::Tensor, torch::Tensor) -> torch::Tensor {
        throw std::runtime_error("lossfail");
      });
  EXPECT_NE(thrown.find("loss_fn threw: lossfail"), std::string::npos)
      << thrown;
  EXPECT_NE(thrown.find("while profiling the loss"), std::string::npos)
      << thrown;
  const auto undefined =
      error_of([](torch::Tensor, torch::Tensor) { return torch::Tensor(); });
  EXPECT_NE(undefined.find("returned an undefined tensor"), std::string::npos)
      << undefined;
  const auto shape = error_of([](torch::Tensor out, torch::Tensor t) {
    return torch::mse_loss(out, t.to(torch::kFloat));  // [4, 10] and [4]
  });
  EXPECT_NE(shape.find("while profiling the loss"), std::string::npos) << shape;
}

// Printing the choice leaves the stream's number format as it was.
TEST_F(AutotuneTest, PrintingTheChoiceKeepsTheStreamsFormat) {
  auto net = model();
  auto x = torch::randn({8, 32});
  auto y = torch::randint(0, 10, {8});
  const auto tuned = autotune(net, x, y, loss_of, quick(2).chunks({2}));
  std::ostringstream out;
  out << 1.23456 << " " << tuned << " " << 1.23456;
  const auto text = out.str();
  EXPECT_EQ(text.rfind(" 1.23456"), text.size() - 8) << text;
  EXPECT_EQ(text.find("1.23456 "), 0u) << text;
}

// Micro-batch counts the model cannot run at are rejected with why, and
// the search goes on: BatchNorm in training refuses micro-batches of one
// row, and a sample of 32 rows cannot profile micro-batches of 64.
TEST_F(AutotuneTest, MicroBatchesThatDoNotRunAreRejectedWithWhy) {
  torch::nn::Sequential net(
      torch::nn::Linear(6, 16),
      torch::nn::BatchNorm1d(16),
      torch::nn::ReLU(),
      torch::nn::Linear(16, 3));
  auto x = torch::randn({16, 6});
  auto y = torch::randint(0, 3, {16});
  const auto tuned =
      autotune(net, x, y, loss_of, quick(2).chunks({1, 2, 4, 8, 16}));
  EXPECT_LT(tuned.chunks, 16);
  bool rejected_16 = false;
  for (const auto& c : tuned.candidates) {
    if (c.chunks == 16) {
      EXPECT_NE(
          c.rejected.find("micro-batches of 1 rows do not run"),
          std::string::npos)
          << c.rejected;
      EXPECT_NE(
          c.rejected.find("more than 1 value per channel"), std::string::npos)
          << c.rejected;
      rejected_16 = true;
    } else {
      EXPECT_TRUE(c.rejected.empty()) << c.rejected;
    }
  }
  EXPECT_TRUE(rejected_16);
  EXPECT_NE(tuned.report(100).find("do not run"), std::string::npos);

  auto deep = model();
  auto x32 = torch::randn({32, 32});
  auto y32 = torch::randint(0, 10, {32});
  const auto half = autotune(
      deep, x32, y32, loss_of, quick(2).batch_size(64).chunks({1, 2, 4}));
  EXPECT_GE(half.chunks, 2);
  bool rejected_1 = false;
  for (const auto& c : half.candidates) {
    if (c.chunks == 1) {
      EXPECT_EQ(c.rejected, "micro-batches of 64 rows, but the sample has 32");
      rejected_1 = true;
    }
  }
  EXPECT_TRUE(rejected_1);

  // When no count runs, the first error is thrown.
  try {
    autotune(net, x, y, loss_of, quick(2).chunks({16}));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("more than 1 value per channel"),
        std::string::npos);
  }
}

// A loss or a model that runs on micro-batches of one row only is the
// user's error, not a micro-batch size to reject: a per-sample loss
// (reduction none: a scalar only for one row) and a last layer that sums
// over the batch (its rows no longer the targets') both fail on the plain
// model. autotune used to reject every other count and choose micro-batches
// of one row, where neither error shows, and the run trained.
TEST_F(AutotuneTest, ErrorsOnlyLargerMicroBatchesMeetAreThrown) {
  auto x = torch::randn({16, 6});
  auto y = torch::randint(0, 3, {16});
  torch::nn::Sequential net(
      torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 3));
  const auto per_sample = [](torch::Tensor out, torch::Tensor t) {
    return torch::nn::functional::cross_entropy(
        out,
        t,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(
            torch::kNone));
  };
  try {
    autotune(net, x, y, per_sample, quick(2).chunks({1, 2, 4, 16}));
    ADD_FAILURE() << "no error for a per-sample loss";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("loss_fn must return a scalar"), std::string::npos)
        << what;
    EXPECT_NE(
        what.find("micro-batches of 1 rows ran but micro-batches of"),
        std::string::npos)
        << what;
  }
  auto sums = net->clone();
  auto summed = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(sums);
  summed->push_back(testing::lambda(
      [](torch::Tensor t) { return t.sum(0, /*keepdim=*/true); }));
  EXPECT_THROW(
      autotune(
          torch::nn::Sequential(summed),
          x,
          y,
          loss_of,
          quick(2).chunks({1, 2, 16})),
      c10::Error);
}

// Frozen parameters hold their values alone: no gradient, no optimizer
// state. The memory model charged them param_scale times over.
TEST_F(AutotuneTest, FrozenParametersAreChargedTheirValuesAlone) {
  const auto net_with = [](bool frozen) {
    torch::manual_seed(0);
    torch::nn::Sequential net(
        torch::nn::Linear(256, 256),
        torch::nn::Linear(256, 256),
        torch::nn::Linear(256, 256),
        torch::nn::Linear(256, 4));
    if (frozen) {
      for (const auto k : c10::irange(3)) {
        for (auto& p : net[k]->parameters()) {
          p.requires_grad_(false);
        }
      }
    }
    return net;
  };
  auto x = torch::randn({8, 256});
  auto y = torch::randint(0, 4, {8});
  const auto options = quick(2)
                           .param_scale(4)
                           .chunks({2})
                           .schedules({Schedule::FillDrain})
                           .checkpoints({Checkpoint::Never});
  const auto trainable = autotune(net_with(false), x, y, loss_of, options);
  const auto frozen = autotune(net_with(true), x, y, loss_of, options);
  // Three frozen layers of 256 x 256 floats: 3 of the 4 bytes a parameter
  // byte was charged are gone, about 768 KiB on the lanes together.
  double trainable_sum = 0;
  double frozen_sum = 0;
  for (const auto b : trainable.predicted_peak_bytes) {
    trainable_sum += b;
  }
  for (const auto b : frozen.predicted_peak_bytes) {
    frozen_sum += b;
  }
  const double freed = 3.0 * 3 * (256 * 256 + 256) * 4;
  EXPECT_NEAR(trainable_sum - frozen_sum, freed, 0.1 * freed)
      << trainable_sum << " against " << frozen_sum;
}

// Tensor::chunk cuts 9 rows into 3 micro-batches of 3: a plan of 4 would
// never run on that batch (tuned.plan failed at train_step), so 4 is
// rejected with why, and the plan of the choice runs.
TEST_F(AutotuneTest, ChunkCountsTheBatchDoesNotCutIntoAreRejected) {
  auto net = model();
  auto x = torch::randn({9, 32});
  auto y = torch::randint(0, 10, {9});
  const auto tuned =
      autotune(net, x, y, loss_of, quick(2).batch_size(9).chunks({3, 4}));
  EXPECT_EQ(tuned.chunks, 3);
  bool rejected_4 = false;
  for (const auto& c : tuned.candidates) {
    if (c.chunks == 4) {
      EXPECT_EQ(
          c.rejected,
          "a batch of 9 rows cuts into 3 micro-batches of at most 3 rows, "
          "not 4");
      rejected_4 = true;
    }
  }
  EXPECT_TRUE(rejected_4);
  GPipe model(net, tuned.options());
  EXPECT_TRUE(model->train_step(x, y, loss_of, tuned.plan).defined());

  // Only such counts: a clear error, not a crash.
  try {
    autotune(net, x, y, loss_of, quick(2).batch_size(9).chunks({4}));
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("no candidate could be simulated: a batch of 9 rows cuts "
                  "into 3 micro-batches"),
        std::string::npos)
        << e.what_without_backtrace();
  }
}

// A schedule, chunk count or checkpoint mode given twice is tried once; of
// candidates predicted alike (one lane's schedules), the one that holds
// less comes first.
TEST_F(AutotuneTest, RepeatsAreTriedOnceAndTiesGoToTheSmallerPeak) {
  auto net = model();
  auto x = torch::randn({16, 32});
  auto y = torch::randint(0, 10, {16});
  const auto once = autotune(
      net,
      x,
      y,
      loss_of,
      quick(1)
          .schedules({Schedule::FillDrain, Schedule::OneFOneB})
          .chunks({4})
          .checkpoints({Checkpoint::Never}));
  const auto twice = autotune(
      net,
      x,
      y,
      loss_of,
      quick(1)
          .schedules(
              {Schedule::FillDrain,
               Schedule::OneFOneB,
               Schedule::FillDrain,
               Schedule::OneFOneB})
          .chunks({4, 4})
          .checkpoints({Checkpoint::Never, Checkpoint::Never}));
  EXPECT_EQ(once.candidates.size(), 2u);
  EXPECT_EQ(twice.candidates.size(), once.candidates.size());
  // One lane runs every cell alone: both schedules take the same time, and
  // 1F1B keeps one micro-batch's activations where fill-drain keeps four.
  EXPECT_EQ(once.schedule, Schedule::OneFOneB) << once.report(10);
  EXPECT_LT(
      most(once.candidates[0].predicted_peak_bytes),
      most(once.candidates[1].predicted_peak_bytes));
}

}  // namespace
}  // namespace gpipe
