// What is Gloo's own, with ranks as threads of this process: its event-loop
// thread on hosts with more ranks than CPUs (Note [Gloo's event loop on
// shared cores] in src/dist/gloo.cpp): the rule that picks its nice value,
// and that the value reaches that thread and no other; and its exceptions,
// which reach the caller as c10::Errors.

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dist/backend.h"
#include "dist/ranks.h"
#include "error_of.h"

namespace {

using gpipe::dist::detail::gloo_loop_nice;

// Sets an environment variable for the scope, then puts back what was.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = std::string(old);
    }
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

std::set<long> thread_ids() {
  std::set<long> ids;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (const auto* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') {
        ids.insert(std::atol(entry->d_name));
      }
    }
    closedir(dir);
  }
  return ids;
}

// The nice value of thread `id` of this process.
int nice_of(long id) {
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(id));
  EXPECT_EQ(errno, 0) << "thread " << id;
  return nice;
}

// Runs two ranks as threads with GPIPE_GLOO_LOOP_NICE at `setting`; while
// both Worlds live, counts the threads made since the start at each nice
// value, and checks that the ranks' own threads kept theirs.
std::pair<int, int> new_threads_at(const char* setting, int nice) {
  const ScopedEnv env("GPIPE_GLOO_LOOP_NICE", setting);
  const auto before = thread_ids();
  std::atomic<int> at_nice{0};
  std::atomic<int> others{0};
  gpipe::dist::testing::run_ranks(2, [&](gpipe::dist::World world) {
    EXPECT_EQ(getpriority(PRIO_PROCESS, 0), 0) << "rank " << world.rank();
    // The groups work: a sum over both ranks.
    auto t = torch::full({4}, static_cast<double>(world.rank() + 1));
    world.all_reduce(t);
    EXPECT_TRUE(torch::equal(t, torch::full({4}, 3.0)));
    world.barrier();
    if (world.rank() == 0) {
      for (const auto id : thread_ids()) {
        if (before.count(id) == 0) {
          (nice_of(id) == nice ? at_nice : others) += 1;
        }
      }
    }
    world.barrier();
  });
  return {at_nice.load(), others.load()};
}

TEST(GlooLoopTest, NiceFollowsTheRanksPerCpu) {
  EXPECT_EQ(gloo_loop_nice(4, 2, nullptr), 19);
  EXPECT_EQ(gloo_loop_nice(3, 2, ""), 19);
  EXPECT_EQ(gloo_loop_nice(2, 2, nullptr), 0);
  EXPECT_EQ(gloo_loop_nice(1, 16, nullptr), 0);
  // The setting wins either way.
  EXPECT_EQ(gloo_loop_nice(4, 2, "0"), 0);
  EXPECT_EQ(gloo_loop_nice(1, 16, "7"), 7);
  EXPECT_EQ(gloo_loop_nice(1, 16, "19"), 19);
  for (const char* bad : {"20", "-1", "high", "5x", " 5"}) {
    EXPECT_THROW(gloo_loop_nice(1, 1, bad), c10::ValueError) << bad;
    const auto message =
        gpipe::testing::error_of([&] { gloo_loop_nice(1, 1, bad); });
    EXPECT_NE(message.find("GPIPE_GLOO_LOOP_NICE"), std::string::npos)
        << message;
    EXPECT_NE(message.find(std::string("'") + bad + "'"), std::string::npos)
        << message;
  }
}

TEST(GlooLoopTest, OnlyTheEventLoopRunsLower) {
  // One device per rank, each with one event-loop thread: those two run at
  // the value set, and every other new thread (c10d's workers) at 0.
  const auto [lowered, others] = new_threads_at("19", 19);
  EXPECT_EQ(lowered, 2);
  EXPECT_GT(others, 0);
  // At 0, nothing is lowered.
  const auto [at_zero, rest] = new_threads_at("0", 0);
  EXPECT_GT(at_zero, 2);
  EXPECT_EQ(rest, 0);
}

// Each rank's error (or "no error") from an all_reduce of the first n - 1
// ranks after the last rank let its World go, and the longest of them in
// seconds.
std::pair<std::vector<std::string>, double> all_reduce_after_the_last_rank_left(
    int64_t n) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::atomic<bool> closed{false};
  std::vector<std::string> messages(static_cast<size_t>(n), "not run");
  std::vector<double> took(static_cast<size_t>(n), 0.0);
  gpipe::dist::testing::run_threads(n, [&](int64_t r) {
    std::optional<gpipe::dist::World> world =
        gpipe::dist::init_from_store(store, r, n, std::chrono::seconds(30));
    if (r == n - 1) {
      world.reset();
      closed = true;
      return;
    }
    while (!closed) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      world->all_reduce(t);
      messages[r] = "no error";
    } catch (const c10::Error& e) {
      messages[r] = e.what_without_backtrace();
    }
    took[r] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
  });
  return {messages, *std::max_element(took.begin(), took.end())};
}

// A collective whose peer has closed its connections fails with a
// c10::Error naming the collective and the rank (Gloo's own is a
// gloo::IoException, which code that catches c10::Error would miss), and
// without waiting for the timeout.
TEST(GlooErrorsTest, ACollectiveWhosePeerIsGoneIsAC10Error) {
  const auto [messages, took] = all_reduce_after_the_last_rank_left(2);
  const auto& message = messages[0];
  EXPECT_NE(message.find("all_reduce"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
  EXPECT_LT(took, 20.0) << message;
}

// Of three ranks, the one whose World went before the collective is named
// (a process that returned, or let its World go, says so on the store).
TEST(GlooErrorsTest, OfThreeRanksTheOneWhoseWorldWentIsNamed) {
  const auto messages = all_reduce_after_the_last_rank_left(3).first;
  for (const auto r : {0, 1}) {
    EXPECT_NE(messages[r].find("rank 2 had left"), std::string::npos)
        << messages[r];
  }
}

// A second World on the store of an earlier one (a job that makes its World
// again after an error, or a test of several Worlds): it starts clean, and
// a failure in it names the rank that left it, not those that let the first
// World go.
TEST(GlooErrorsTest, ASecondWorldOnOneStoreNamesOnlyItsOwnRanks) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t n = 3;
  auto sum_of_ones = [](gpipe::dist::World& world) {
    auto t = torch::ones({4});
    world.all_reduce(t);
    return t[0].item<double>();
  };
  gpipe::dist::testing::run_threads(n, [&](int64_t r) {
    auto world =
        gpipe::dist::init_from_store(store, r, n, std::chrono::seconds(30));
    EXPECT_EQ(sum_of_ones(world), 3.0);
  });
  std::atomic<bool> closed{false};
  std::vector<std::string> messages(static_cast<size_t>(n), "not run");
  gpipe::dist::testing::run_threads(n, [&](int64_t r) {
    if (r == 1) {
      // The others wait for this: set however rank 1 ends.
      struct Closed {
        std::atomic<bool>& closed;
        ~Closed() {
          closed = true;
        }
      } at_end{closed};
      std::optional<gpipe::dist::World> world =
          gpipe::dist::init_from_store(store, r, n, std::chrono::seconds(30));
      EXPECT_EQ(sum_of_ones(*world), 3.0);
      world.reset();
      return;
    }
    std::optional<gpipe::dist::World> world =
        gpipe::dist::init_from_store(store, r, n, std::chrono::seconds(30));
    EXPECT_EQ(sum_of_ones(*world), 3.0);
    while (!closed) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    try {
      sum_of_ones(*world);
      messages[r] = "no error";
    } catch (const c10::Error& e) {
      messages[r] = e.what_without_backtrace();
    }
  });
  for (const auto r : {0, 2}) {
    const auto& message = messages[r];
    EXPECT_NE(message.find("rank 1 had left"), std::string::npos) << message;
    EXPECT_EQ(message.find("rank 0 and rank 1"), std::string::npos) << message;
    EXPECT_EQ(message.find("rank 1 and rank 2"), std::string::npos) << message;
  }
}

// Ranks that pass tensors of other sizes or dtypes to one collective are
// refused alike (Gloo itself would abort the process), and the World works
// on afterwards.
TEST(GlooErrorsTest, CollectivesOfOtherSizesAreRefusedOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors;
  gpipe::dist::testing::run_ranks(2, [&](gpipe::dist::World world) {
    const auto r = world.rank();
    for (const int variant : {0, 1, 2}) {
      // 0: 3 against 5 elements (all_reduce); 1: float against double
      // (all_reduce); 2: 3 against 5 elements (broadcast).
      auto t = variant == 1
                   ? torch::ones({4}, r == 0 ? torch::kFloat : torch::kDouble)
                   : torch::ones({r == 0 ? 3 : 5});
      try {
        if (variant == 2) {
          world.broadcast(t, 0);
        } else {
          world.all_reduce(t);
        }
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back("no error");
      } catch (const c10::ValueError& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back(e.what_without_backtrace());
      }
    }
    auto sum = torch::full({2}, static_cast<double>(r + 1));
    world.all_reduce(sum);
    EXPECT_TRUE(torch::equal(sum, torch::full({2}, 3.0)));
  });
  ASSERT_EQ(errors.size(), 6u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("same size and dtype on every rank"), std::string::npos)
        << e;
  }
}

// What the agreement did not cover: a shape of the same size ([2, 3]
// against [3, 2] was summed silently), another root on each rank (both
// waited out the timeout, and the World was broken after), a dtype no rank
// can sum (blamed on a dead rank), and a negative color on one rank of a
// split (the others waited out the timeout). Each is refused on every rank
// at once, and the World works on afterwards.
TEST(GlooErrorsTest, ShapesRootsDtypesAndColorsAreRefusedOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors;
  const auto start = std::chrono::steady_clock::now();
  gpipe::dist::testing::run_ranks(2, [&](gpipe::dist::World world) {
    const auto r = world.rank();
    auto note = [&](const std::function<void()>& f) {
      try {
        f();
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back("no error");
      } catch (const c10::ValueError& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back(e.what_without_backtrace());
      }
    };
    note([&] {
      auto t = r == 0 ? torch::ones({2, 3}) : torch::ones({3, 2});
      world.all_reduce(t);
    });
    note([&] {
      auto t = torch::ones({4});
      world.broadcast(t, r);
    });
    note([&] {
      auto t = torch::ones({4}, torch::kBool);
      world.all_reduce(t);
    });
    note([&] { world.split(r == 0 ? -1 : 0, 0); });
    auto sum = torch::full({2}, static_cast<double>(r + 1));
    world.all_reduce(sum);
    EXPECT_TRUE(torch::equal(sum, torch::full({2}, 3.0)));
  });
  const std::chrono::duration<double> took =
      std::chrono::steady_clock::now() - start;
  EXPECT_LT(took.count(), 10.0);
  ASSERT_EQ(errors.size(), 8u);
  const std::vector<std::string> expected{
      // Each rank's tensor, not only its own.
      "same shape on every rank, but the ranks passed tensors of other "
      "shapes (rank 0: 6 of Float, shape [2, 3]; rank 1: 6 of Float, shape "
      "[3, 2])",
      "same root on every rank, but the ranks passed roots from 0 to 1",
      "expects a tensor of real numbers, but got Bool",
      "split expects a color >= 0 on every rank, but rank 0 gave -1"};
  for (const auto& text : expected) {
    EXPECT_EQ(
        std::count_if(
            errors.begin(),
            errors.end(),
            [&](const std::string& e) {
              return e.find(text) != std::string::npos;
            }),
        2)
        << text;
  }
}

// An argument that one rank refuses on its own (an undefined or strided
// tensor, a root out of range) was refused there alone: the others waited
// in the collective's agreement, which the refusing rank's next collective
// answered, out of step ("the ranks passed from 1 to 3 elements"), and the
// World was broken. Now every rank refuses it, the refusing rank with its
// own error, the others naming it, and the World stays usable.
TEST(GlooErrorsTest, AnArgumentOneRankRefusesIsRefusedOnEveryRank) {
  std::mutex mutex;
  std::vector<std::vector<std::string>> errors(2);
  gpipe::dist::testing::run_ranks(2, [&](gpipe::dist::World world) {
    const auto r = world.rank();
    auto note = [&](const std::function<void()>& f) {
      std::string seen = "no error";
      try {
        f();
      } catch (const c10::IndexError& e) {
        seen = std::string("IndexError: ") + e.what_without_backtrace();
      } catch (const c10::ValueError& e) {
        seen = std::string("ValueError: ") + e.what_without_backtrace();
      } catch (const c10::Error& e) {
        seen = std::string("Error: ") + e.what_without_backtrace();
      }
      std::lock_guard<std::mutex> lock(mutex);
      errors[r].push_back(seen);
    };
    note([&] {
      auto t = r == 1 ? torch::Tensor() : torch::ones({3});
      world.all_reduce(t);
    });
    note([&] {
      auto t = r == 0 ? torch::ones({3, 2}).t() : torch::ones({2, 3});
      world.all_reduce(t);
    });
    note([&] {
      auto t = torch::ones({3});
      world.broadcast(t, r == 1 ? 7 : 0);
    });
    auto sum = torch::full({2}, static_cast<double>(r + 1));
    world.all_reduce(sum);
    EXPECT_TRUE(torch::equal(sum, torch::full({2}, 3.0)));
    auto root = torch::full({1}, static_cast<double>(r));
    world.broadcast(root, 1);
    EXPECT_EQ(root.item<double>(), 1.0);
  });
  // Who refused: rank 1, rank 0, rank 1.
  const std::vector<int> refuser{1, 0, 1};
  const std::vector<std::string> own{
      "ValueError: gpipe::dist::World::all_reduce expects a dense contiguous "
      "tensor, but got an undefined one",
      "ValueError: gpipe::dist::World::all_reduce expects a dense contiguous "
      "tensor, but got one that is not",
      "IndexError: gpipe::dist::World::broadcast expects a root rank in [0, "
      "2), but got 7"};
  for (size_t k = 0; k < 3; ++k) {
    const auto& mine = errors[refuser[k]][k];
    const auto& other = errors[1 - refuser[k]][k];
    EXPECT_EQ(mine.rfind(own[k], 0), 0u) << mine;
    EXPECT_NE(
        other.find(
            "ValueError: gpipe::dist::World::" +
            std::string(k < 2 ? "all_reduce" : "broadcast") + ": rank " +
            std::to_string(refuser[k]) + " refused its own arguments"),
        std::string::npos)
        << other;
  }
}

// A World whose collective timed out is closed (Gloo closes its pairs after
// a timeout): it used to throw at once, and the next collective blamed a
// dead rank ("Application timeout caused pair closure"). Now every rank
// hears the first error, and later collectives say the World is closed.
TEST(GlooErrorsTest, AWorldWhoseCollectiveTimedOutIsClosedOnEveryRank) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::vector<std::vector<std::string>> errors(2);
  gpipe::dist::testing::run_threads(2, [&](int64_t r) {
    auto world = gpipe::dist::init_from_store(
        store, r, 2, std::chrono::milliseconds(1500));
    auto note = [&](const std::function<void()>& f) {
      std::string seen = "no error";
      try {
        f();
      } catch (const c10::Error& e) {
        seen = e.what_without_backtrace();
      }
      std::lock_guard<std::mutex> lock(mutex);
      errors[r].push_back(seen);
    };
    if (r == 0) {
      note([&] { world.barrier(); });  // rank 1 skips it
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    }
    note([&] {
      auto t = torch::ones({2});
      world.all_reduce(t);
    });
  });
  ASSERT_EQ(errors[0].size(), 2u);
  ASSERT_EQ(errors[1].size(), 1u);
  EXPECT_NE(
      errors[0][0].find("the World::barrier did not end within 1.5 s"),
      std::string::npos)
      << errors[0][0];
  for (const auto& later : {errors[0][1], errors[1][0]}) {
    EXPECT_NE(
        later.find("rank 0: gpipe::dist: the World::barrier did not end"),
        std::string::npos)
        << later;
    EXPECT_NE(later.find("closed after a failure"), std::string::npos) << later;
  }
}

// A broadcast of bool, int16 or bfloat16 (which Gloo broadcasts not) and
// an all-reduce of int16 or bfloat16 (which it sums not) blamed the other
// rank as dead and closed the World: a broadcast copies the bytes of any
// dtype, and those sums run in a wider dtype.
TEST(GlooErrorsTest, EveryDtypeIsBroadcastAndInt16AndBFloat16AreSummed) {
  std::mutex mutex;
  std::vector<std::string> errors;
  gpipe::dist::testing::run_ranks(2, [&](gpipe::dist::World world) {
    const auto r = world.rank();
    try {
      for (const auto dtype :
           {torch::kBool,
            torch::kShort,
            torch::kBFloat16,
            torch::kComplexFloat,
            torch::kFloat}) {
        const auto root = torch::arange(5).remainder(2).to(dtype);
        auto t = r == 1 ? root.clone() : torch::zeros({5}, dtype);
        world.broadcast(t, 1);
        EXPECT_TRUE(torch::equal(t, root)) << dtype << ": " << t;
        auto scalar = torch::full({}, r == 1 ? 1 : 0).to(dtype);
        world.broadcast(scalar, 1);
        EXPECT_TRUE(torch::equal(scalar, torch::full({}, 1).to(dtype)))
            << dtype;
      }
      // A contiguous tensor of one element whose stride is not 1 (a column
      // of a row), and a lazy conjugate, refused alike on every rank.
      auto row = torch::zeros({1, 3});
      auto column = row.select(1, 0);
      if (r == 1) {
        column.fill_(7);
      }
      world.broadcast(column, 1);
      EXPECT_EQ(row[0][0].item<float>(), 7.0F);
      auto conjugate = torch::ones({2}, torch::kComplexFloat).conj();
      EXPECT_THROW(world.broadcast(conjugate, 0), c10::ValueError);
      for (const auto dtype : {torch::kShort, torch::kBFloat16}) {
        auto t = torch::full({3}, r + 1).to(dtype);
        world.all_reduce(t);
        EXPECT_EQ(t.scalar_type(), dtype);
        EXPECT_TRUE(torch::equal(t, torch::full({3}, 3).to(dtype)))
            << dtype << ": " << t;
      }
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors.push_back(e.what_without_backtrace());
    }
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

// Two threads of each rank calling a World's collectives at once had their
// agreements and their tensors interleave on the one group: sums of the
// other thread's tensor, or Gloo's abort where the sizes differed. On each
// rank they now run one at a time (Note [A World's collectives from
// several threads]); here every thread passes alike, so any pairing sums
// right. (Calls of other kinds at once may pair up in another order on
// another rank: the agreement refuses that, on every rank.)
TEST(GlooErrorsTest, CollectivesCalledFromTwoThreadsAtOnceRunOneAtATime) {
  std::mutex mutex;
  std::vector<std::string> errors;
  gpipe::dist::testing::run_ranks(2, [&](gpipe::dist::World world) {
    auto body = [&] {
      try {
        for (int i = 0; i < 20; ++i) {
          auto t = torch::full({1000}, static_cast<float>(world.rank() + 1));
          world.all_reduce(t);
          EXPECT_TRUE(torch::equal(t, torch::full({1000}, 3.0F)));
        }
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back(e.what_without_backtrace());
      }
    };
    std::thread other(body);
    body();
    other.join();
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

}  // namespace
