#include "engine/lane.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <vector>

namespace {

using gpipe::detail::FirstError;
using gpipe::detail::Lane;

TEST(WorkerTest, LaneRunsTasksInPostOrder) {
  std::vector<int> order;
  {
    Lane lane;
    for (int k = 0; k < 100; ++k) {
      lane.post([&order, k] { order.push_back(k); });
    }
  }
  ASSERT_EQ(order.size(), 100u);
  for (int k = 0; k < 100; ++k) {
    EXPECT_EQ(order[k], k);
  }
}

TEST(WorkerTest, DestructorRunsEveryQueuedTask) {
  std::atomic<int> count{0};
  {
    Lane lane;
    for (int k = 0; k < 10; ++k) {
      lane.post([&count] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        ++count;
      });
    }
  }
  EXPECT_EQ(count.load(), 10);
}

TEST(WorkerTest, LanesAreDistinctThreads) {
  Lane a;
  Lane b;
  std::thread::id ida;
  std::thread::id idb;
  std::atomic<int> done{0};
  a.post([&] {
    ida = std::this_thread::get_id();
    ++done;
  });
  b.post([&] {
    idb = std::this_thread::get_id();
    ++done;
  });
  while (done.load() < 2) {
    std::this_thread::yield();
  }
  EXPECT_NE(ida, idb);
  EXPECT_NE(ida, std::this_thread::get_id());
  EXPECT_EQ(ida, a.thread_id());
}

TEST(WorkerTest, InitRunsOnTheLaneBeforeTasks) {
  std::thread::id init_id;
  std::thread::id task_id;
  {
    Lane lane([&] { init_id = std::this_thread::get_id(); });
    lane.post([&] { task_id = std::this_thread::get_id(); });
  }
  EXPECT_EQ(init_id, task_id);
}

TEST(WorkerTest, FirstErrorWins) {
  FirstError error;
  EXPECT_FALSE(error.has());
  EXPECT_TRUE(error.set(std::make_exception_ptr(std::runtime_error("first"))));
  EXPECT_FALSE(
      error.set(std::make_exception_ptr(std::runtime_error("second"))));
  try {
    error.rethrow_and_clear();
    FAIL() << "nothing rethrown";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_FALSE(error.has());
}

TEST(WorkerTest, ContextKeepsTheTypeOfC10Errors) {
  std::exception_ptr error;
  try {
    TORCH_CHECK_VALUE(false, "bad value");
  } catch (...) {
    error = gpipe::detail::with_context(
        std::current_exception(), "partition 1, micro-batch 2, forward");
  }
  try {
    std::rethrow_exception(error);
  } catch (const c10::ValueError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("bad value"), std::string::npos);
    EXPECT_NE(
        what.find("partition 1, micro-batch 2, forward"), std::string::npos);
  }
}

TEST(WorkerTest, ContextTurnsOtherExceptionsIntoC10Errors) {
  auto error = gpipe::detail::with_context(
      std::make_exception_ptr(std::runtime_error("boom")), "partition 0");
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("boom"), std::string::npos);
    EXPECT_NE(what.find("partition 0"), std::string::npos);
  }
}

}  // namespace
