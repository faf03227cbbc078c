#include <c10/util/Exception.h>
#include <gpipe/schedule.h>
#include <gtest/gtest.h>

#include <iostream>
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

TEST(ScheduleTest, FillDrainLanesAreTheClockCyclesOfTheirStage) {
  // Each lane's row is written directly; it must be what the cycles give.
  for (int64_t m : {0, 1, 3, 5}) {
    for (int64_t n : {1, 2, 4}) {
      for (int64_t j = 0; j < n; ++j) {
        auto expected = gpipe::cells_of_partition(gpipe::clock_cycles(m, n), j);
        const auto backward =
            gpipe::cells_of_partition(gpipe::reverse_clock_cycles(m, n), j);
        expected.insert(expected.end(), backward.begin(), backward.end());
        EXPECT_EQ(
            gpipe::lane_order(gpipe::Schedule::FillDrain, m, n, j), expected)
            << m << " micro-batches, " << n << " stages, stage " << j;
      }
    }
  }
}

TEST(ScheduleTest, EmptySizesGiveNoSteps) {
  EXPECT_TRUE(gpipe::clock_cycles(0, 3).empty());
  EXPECT_TRUE(gpipe::clock_cycles(3, 0).empty());
  EXPECT_THROW(gpipe::clock_cycles(-1, 2), c10::ValueError);
}

std::string show(const std::vector<gpipe::Cell>& cells) {
  std::string out;
  for (size_t k = 0; k < cells.size(); ++k) {
    out += (k ? " " : "") + gpipe::to_string(cells[k]);
  }
  return out;
}

TEST(ScheduleTest, OneFOneBLaneOrders) {
  using gpipe::Schedule;
  // m = 4, n = 2: partition 0 warms up with one forward.
  EXPECT_EQ(
      show(gpipe::lane_order(Schedule::OneFOneB, 4, 2, 0)),
      "F(0,0) F(1,0) B(0,0) F(2,0) B(1,0) F(3,0) B(2,0) B(3,0)");
  EXPECT_EQ(
      show(gpipe::lane_order(Schedule::OneFOneB, 4, 2, 1)),
      "F(0,1) B(0,1) F(1,1) B(1,1) F(2,1) B(2,1) F(3,1) B(3,1)");
  // Fewer micro-batches than the warm-up wants.
  EXPECT_EQ(
      show(gpipe::lane_order(Schedule::OneFOneB, 1, 3, 0)), "F(0,0) B(0,0)");
  EXPECT_EQ(
      show(gpipe::lane_order(Schedule::FillDrain, 2, 2, 0)),
      "F(0,0) F(1,0) B(1,0) B(0,0)");
}

TEST(ScheduleTest, TrainingStepsPrintTheWholeStep) {
  using gpipe::Schedule;
  const auto one_f_one_b =
      show(gpipe::training_steps(Schedule::OneFOneB, 4, 2));
  std::cout << "1F1B m=4 n=2: " << one_f_one_b << "\n";
  EXPECT_EQ(
      one_f_one_b,
      "[F(0,0)][F(1,0) F(0,1)][B(0,1)][B(0,0) F(1,1)][F(2,0) B(1,1)]"
      "[B(1,0) F(2,1)][F(3,0) B(2,1)][B(2,0) F(3,1)][B(3,1)][B(3,0)]");
  const auto fill_drain =
      show(gpipe::training_steps(Schedule::FillDrain, 3, 2));
  std::cout << "fill-drain m=3 n=2: " << fill_drain << "\n";
  EXPECT_EQ(
      fill_drain,
      "[F(0,0)][F(1,0) F(0,1)][F(2,0) F(1,1)][F(2,1)][B(2,1)][B(2,0) B(1,1)]"
      "[B(1,0) B(0,1)][B(0,0)]");
}

TEST(ScheduleTest, SchedulesRunEveryCellOnceWithoutDeadlock) {
  for (auto schedule :
       {gpipe::Schedule::FillDrain, gpipe::Schedule::OneFOneB}) {
    for (int64_t m = 1; m <= 9; ++m) {
      for (int64_t n = 1; n <= 5; ++n) {
        auto steps = gpipe::training_steps(schedule, m, n);
        size_t cells = 0;
        for (const auto& s : steps) {
          cells += s.size();
        }
        EXPECT_EQ(static_cast<int64_t>(cells), 2 * m * n);
        // Both schedules have the same bubble: 2 (m + n - 1) unit steps
        // when forward and backward cost the same.
        EXPECT_EQ(static_cast<int64_t>(steps.size()), 2 * (m + n - 1))
            << gpipe::to_string(schedule) << " m=" << m << " n=" << n;
        for (int64_t j = 0; j < n; ++j) {
          EXPECT_EQ(
              show(gpipe::cells_of_partition(steps, j)),
              show(gpipe::lane_order(schedule, m, n, j)));
        }
      }
    }
  }
}

TEST(ScheduleTest, OneFOneBHoldsAtMostNMinusJMicroBatches) {
  for (int64_t m = 1; m <= 32; m *= 2) {
    for (int64_t n = 1; n <= 4; ++n) {
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(
            gpipe::max_in_flight(
                gpipe::lane_order(gpipe::Schedule::OneFOneB, m, n, j)),
            std::min(m, n - j));
        EXPECT_EQ(
            gpipe::max_in_flight(
                gpipe::lane_order(gpipe::Schedule::FillDrain, m, n, j)),
            m);
      }
    }
  }
}

TEST(ScheduleTest, ScheduleNames) {
  EXPECT_EQ(gpipe::to_string(gpipe::Schedule::OneFOneB), "1f1b");
  EXPECT_EQ(
      gpipe::schedule_from_string("fill_drain"), gpipe::Schedule::FillDrain);
  EXPECT_THROW(gpipe::schedule_from_string("gpipe"), c10::ValueError);
}

}  // namespace
