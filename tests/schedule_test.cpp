#include <gpipe/schedule.h>
#include <gtest/gtest.h>

#include <string>

namespace {

std::string show(const gpipe::Steps& steps) {
  std::string out;
  for (const auto& step : steps) {
    out += "[";
    for (size_t k = 0; k < step.size(); ++k) {
      out += (k ? " " : "") + gpipe::to_string(step[k]);
    }
    out += "]";
  }
  return out;
}

TEST(ScheduleTest, ClockCyclesMatchTorchgpipe) {
  EXPECT_EQ(show(gpipe::clock_cycles(1, 1)), "[F(0,0)]");
  EXPECT_EQ(show(gpipe::clock_cycles(1, 3)), "[F(0,0)][F(0,1)][F(0,2)]");
  EXPECT_EQ(show(gpipe::clock_cycles(3, 1)), "[F(0,0)][F(1,0)][F(2,0)]");
  EXPECT_EQ(
      show(gpipe::clock_cycles(3, 3)),
      "[F(0,0)][F(1,0) F(0,1)][F(2,0) F(1,1) F(0,2)][F(2,1) F(1,2)][F(2,2)]");
  EXPECT_EQ(
      show(gpipe::clock_cycles(4, 2)),
      "[F(0,0)][F(1,0) F(0,1)][F(2,0) F(1,1)][F(3,0) F(2,1)][F(3,1)]");
}

TEST(ScheduleTest, ClockCyclesHaveMPlusNMinusOneSteps) {
  for (int64_t m = 1; m <= 8; ++m) {
    for (int64_t n = 1; n <= 5; ++n) {
      auto steps = gpipe::clock_cycles(m, n);
      EXPECT_EQ(static_cast<int64_t>(steps.size()), m + n - 1);
      size_t cells = 0;
      for (const auto& s : steps) {
        cells += s.size();
      }
      EXPECT_EQ(static_cast<int64_t>(cells), m * n);
    }
  }
}

TEST(ScheduleTest, ReverseClockCyclesRunBackwardLastFirst) {
  EXPECT_EQ(
      show(gpipe::reverse_clock_cycles(3, 2)),
      "[B(2,1)][B(1,1) B(2,0)][B(0,1) B(1,0)][B(0,0)]");
}

TEST(ScheduleTest, CellsOfPartitionFollowTheSteps) {
  auto forward = gpipe::cells_of_partition(gpipe::clock_cycles(3, 2), 1);
  ASSERT_EQ(forward.size(), 3u);
  EXPECT_EQ(forward[0], (gpipe::Cell{0, 1, gpipe::Phase::Forward}));
  EXPECT_EQ(forward[2], (gpipe::Cell{2, 1, gpipe::Phase::Forward}));
  auto backward =
      gpipe::cells_of_partition(gpipe::reverse_clock_cycles(3, 2), 0);
  ASSERT_EQ(backward.size(), 3u);
  EXPECT_EQ(backward[0].micro_batch, 2);
  EXPECT_EQ(backward[2].micro_batch, 0);
}

TEST(ScheduleTest, EmptySizesGiveNoSteps) {
  EXPECT_TRUE(gpipe::clock_cycles(0, 3).empty());
  EXPECT_TRUE(gpipe::clock_cycles(3, 0).empty());
  EXPECT_THROW(gpipe::clock_cycles(-1, 2), std::invalid_argument);
}

}  // namespace
