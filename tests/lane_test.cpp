#include "engine/lane.h"

#include <c10/util/Exception.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sanitized.h"

namespace {

using gpipe::detail::FirstError;
using gpipe::detail::Lane;

// A GPIPE_MALLOC that names nothing gpipe knows is refused by name when the
// first lane would be made, not taken for the default.
TEST(WorkerTest, UnknownMallocChoiceIsRefused) {
  const char* old = std::getenv("GPIPE_MALLOC");
  const std::string kept = old != nullptr ? old : "";
  setenv("GPIPE_MALLOC", "jemalloc", 1);
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  std::string message;
  try {
    gpipe::GPipe model(net, gpipe::GPipeOptions({1, 1}));
  } catch (const c10::ValueError& e) {
    message = e.what_without_backtrace();
  }
  if (old != nullptr) {
    setenv("GPIPE_MALLOC", kept.c_str(), 1);
  } else {
    unsetenv("GPIPE_MALLOC");
  }
  EXPECT_NE(message.find("GPIPE_MALLOC"), std::string::npos) << message;
  EXPECT_NE(message.find("'jemalloc'"), std::string::npos) << message;
  // Unset again, the same model is made and runs.
  gpipe::GPipe model(net, gpipe::GPipeOptions({1, 1}));
  EXPECT_EQ(
      model->forward(torch::ones({2, 4})).sizes(), (c10::IntArrayRef{2, 4}));
}

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

// The minor page faults per step of 5 training steps of `net` through
// `options`, after 5 of warm-up (the memory of a step is taken once).
int64_t faults_per_step(
    torch::nn::Sequential net,
    const torch::Tensor& x,
    const gpipe::GPipeOptions& options) {
  gpipe::GPipe model(net, options);
  auto step = [&] {
    model->zero_grad();
    model->forward(x).sum().backward();
  };
  for (int k = 0; k < 5; ++k) {
    step();
  }
  auto faults = [] {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_minflt;
  };
  const auto before = faults();
  for (int k = 0; k < 5; ++k) {
    step();
  }
  return (faults() - before) / 5;
}

// Why gpipe's malloc settings cannot be checked here, or null: in the
// sanitizer build and off glibc, mallopt does not govern the allocator;
// with GPIPE_MALLOC=system the user asked gpipe to leave malloc alone, and
// the faults are glibc's default behaviour, which these tests do not judge.
const char* malloc_not_gpipes() {
#if defined(GPIPE_SANITIZED) || !defined(__GLIBC__)
  return "a sanitizer's allocator, or not glibc's malloc";
#else
  const char* choice = std::getenv("GPIPE_MALLOC");
  if (choice != nullptr && std::string(choice) == "system") {
    return "GPIPE_MALLOC=system: lanes leave malloc alone";
  }
  return nullptr;
#endif
}

// Note [Lanes and glibc's malloc]: steps through lanes reuse the memory of
// the steps before them instead of faulting in fresh pages (with
// GPIPE_MALLOC=system, and the skip below taken out, 5,356 faults per step
// here; with the lanes' setting, 0 to about 200).
TEST(WorkerTest, LaneStepsReuseTheirMemory) {
  if (const char* why = malloc_not_gpipes()) {
    // Skipped: gpipe does not set malloc (malloc_not_gpipes)
    GTEST_SKIP() << why;  // gpipe does not set malloc (malloc_not_gpipes)
  }
  at::set_num_threads(1);
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int k = 0; k < 4; ++k) {
    net->push_back(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1)));
    net->push_back(torch::nn::ReLU());
  }
  const auto per_step = faults_per_step(
      net,
      torch::randn({32, 16, 32, 32}),
      gpipe::GPipeOptions({4, 4})
          .chunks(1)
          .checkpoint(gpipe::Checkpoint::Never)
          .threads_per_lane(1));
  // A few hundred remain on a busy machine (thread stacks, the heap's
  // last growth), against thousands without the setting.
  EXPECT_LT(per_step, 1000) << "minor page faults per step";
}

// The same when a lane holds more than one of glibc's heaps (64 MiB): 128
// MiB of saved activations per lane. With one arena per thread and only the
// mmap and trim settings (no top pad), glibc unmapped each free heap after
// the first: 13,000 faults per step here.
TEST(WorkerTest, LaneStepsReuseMemoryBeyondOneHeap) {
  if (const char* why = malloc_not_gpipes()) {
    // Skipped: gpipe does not set malloc (malloc_not_gpipes)
    GTEST_SKIP() << why;  // gpipe does not set malloc (malloc_not_gpipes)
  }
  at::set_num_threads(1);
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int k = 0; k < 2; ++k) {
    net->push_back(torch::nn::Linear(64, 64));
    for (int s = 0; s < 16; ++s) {
      // Each saves its 8 MiB output for backward.
      net->push_back(torch::nn::Sigmoid());
    }
  }
  const auto per_step = faults_per_step(
      net,
      torch::randn({32768, 64}),
      gpipe::GPipeOptions({17, 17})
          .chunks(1)
          .checkpoint(gpipe::Checkpoint::Never)
          .threads_per_lane(1));
  // Half of what a missing top pad costs: an arena still grows by a block
  // (2,048 pages) now and then while the steps settle.
  EXPECT_LT(per_step, 6500) << "minor page faults per step";
}

// TSan ends a child that starts threads after a multi-threaded fork
// (die_after_fork); the other builds run these parts.
#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadsAfterFork = false;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kThreadsAfterFork = false;
#else
constexpr bool kThreadsAfterFork = true;
#endif
#else
constexpr bool kThreadsAfterFork = true;
#endif

// Runs `child` in a forked child with 60 s to finish (a hang ends in
// SIGALRM); returns its exit status, or 128 + the signal that ended it.
int in_forked_child(const std::function<int()>& child) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(60);
    int code = 99;
    try {
      code = child();
    } catch (...) {
      code = 98;
    }
    _exit(code);  // no atexit handlers, no leak check of the child's copy
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

torch::nn::Sequential four_linears() {
  torch::nn::Sequential net;
  for (int k = 0; k < 4; ++k) {
    net->push_back(torch::nn::Linear(8, 8));
  }
  return net;
}

float one_step(gpipe::GPipe& model) {
  const auto x = torch::randn({8, 8});
  const auto t = torch::randn({8, 8});
  return model
      ->train_step(
          x,
          t,
          [](torch::Tensor y, torch::Tensor target) {
            return torch::mse_loss(y, target);
          })
      .item<float>();
}

// Note [Lanes across fork()]: a GPipe whose lanes ran in the parent used to
// hang a forked child that trained with it (forever) or only destroyed it
// (in the lane's condition variable). Now the child is told, lets it go,
// and trains with a GPipe of its own.
TEST(ForkTest, APipelineOfTheParentIsRefusedInTheChildAndLetGo) {
  auto model = std::make_optional<gpipe::GPipe>(
      four_linears(), gpipe::GPipeOptions({2, 2}).chunks(4));
  ASSERT_TRUE(std::isfinite(one_step(*model)));
  const auto status = in_forked_child([&] {
    try {
      one_step(*model);
      return 3;  // ran
    } catch (const c10::ValueError& e) {
      const std::string what = e.what_without_backtrace();
      if (what.find("a child made by fork()") == std::string::npos ||
          what.find("Build a new GPipe in the child") == std::string::npos) {
        return 4;
      }
    }
    try {
      (void)(*model)->forward(torch::randn({8, 8}));
      return 5;
    } catch (const c10::ValueError&) {
    }
    model.reset();  // hung here
    // (With CUDA devices, LibTorch refuses autograd in a child forked after
    // a backward: the guide says so.)
    if (kThreadsAfterFork && !torch::cuda::is_available()) {
      gpipe::GPipe own(four_linears(), gpipe::GPipeOptions({2, 2}).chunks(4));
      if (!std::isfinite(one_step(own))) {
        return 6;
      }
    }
    return 0;
  });
  EXPECT_EQ(status, 0) << "3: trained, 4: another message, 5: forward ran, "
                          "6: no loss, 128+14: hung";
  // The parent's model is untouched.
  EXPECT_TRUE(std::isfinite(one_step(*model)));
}

#if !defined(__SANITIZE_THREAD__)
// A lane's thread that cannot start (a limit on threads) was a bare
// std::system_error ("Resource temporarily unavailable"), which callers
// catching c10::Error missed; it is a c10::Error that says what gpipe was
// starting.
TEST(WorkerTest, ALaneThreadThatCannotStartIsAC10Error) {
  if (!kThreadsAfterFork) {
    return;  // the child would be ended for the thread it tries to start
  }
  constexpr int kNoLimit = 7;
  const auto status = in_forked_child([] {
    // One process of this user at most: as root, the limit holds only
    // for another user.
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) {
      return kNoLimit;
    }
    const rlimit one{1, 1};
    if (setrlimit(RLIMIT_NPROC, &one) != 0) {
      return kNoLimit;
    }
    try {
      gpipe::GPipe model(four_linears(), gpipe::GPipeOptions({2, 2}));
      return 3;  // started
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      return what.find("gpipe could not start a lane's thread") !=
                     std::string::npos
                 ? 0
                 : 4;
    } catch (...) {
      return 5;
    }
  });
  if (status == kNoLimit) {
    // Skipped: no thread limit can be set here (a root without another user
    // to become, as in a rootless container).
    GTEST_SKIP()
        << "no thread limit can be set here";  // root, no user to become
  }
  EXPECT_EQ(status, 0) << "3: the lanes started, 4: another message, 5: not "
                          "a c10::Error";
}
#endif

}  // namespace
