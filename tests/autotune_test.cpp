// autotune: the fastest candidate that fits the memory limit, what it
// rejected and why, options that build a pipeline which trains as the
// plain model does, and clear errors.

#include <c10/util/irange.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "common.h"

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
  // A limit below the unconstrained choice's peak (bytes are counted, not
  // timed: the same in both runs): something else, that fits, and the
  // faster ones rejected with the lane and the numbers. (The two runs time
  // the layers apart, so their predicted times are not compared.)
  const auto limit = static_cast<int64_t>(most(free.predicted_peak_bytes)) - 1;
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
  try {
    autotune(net, x, y.narrow(0, 0, 4), loss_of, quick(2));
    ADD_FAILURE() << "no error for 8 inputs and 4 targets";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace()).find("the same rows"),
        std::string::npos);
  }
}

}  // namespace
}  // namespace gpipe
