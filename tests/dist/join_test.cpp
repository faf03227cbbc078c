// Joining a job from the environment (init_from_env): its refusals are
// c10::Errors of the kind that fits, whose what() is the message alone,
// without LibTorch's backtrace (Note [Errors without LibTorch's backtrace]
// in src/text.h), and a rank left alone gives up within its timeout.

#include <dirent.h>
#include <gpipe/dist.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "../error_of.h"
#include "dist/connection.h"
#include "dist/meeting.h"

namespace gpipe {
namespace {

// Sets the variables for the test's lifetime, then puts back what was there.
class Environment {
 public:
  explicit Environment(const std::map<std::string, std::string>& values) {
    for (const auto& [name, value] : values) {
      const char* before = std::getenv(name.c_str());
      saved_[name] = before ? std::optional<std::string>(before) : std::nullopt;
      ::setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~Environment() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

// A TCP port of this host that nothing listens on just now.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), length), 0);
  EXPECT_EQ(
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

void expect_no_backtrace(const c10::Error& e) {
  const std::string what = e.what();
  EXPECT_EQ(what.find("frame #"), std::string::npos) << what;
  EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
  EXPECT_NE(what.find(e.what_without_backtrace()), std::string::npos) << what;
}

TEST(JoinTest, ARankLeftAloneGivesUpWithinItsTimeoutWithoutABacktrace) {
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", std::to_string(free_port())},
       {"RANK", "0"},
       {"WORLD_SIZE", "2"},
       {"LOCAL_RANK", "0"},
       {"LOCAL_WORLD_SIZE", "2"}});
  const auto start = std::chrono::steady_clock::now();
  try {
    dist::init_from_env(std::chrono::milliseconds(1500));
    ADD_FAILURE() << "rank 0 of 2 joined alone";
  } catch (const c10::ValueError& e) {
    ADD_FAILURE() << "a ValueError: " << e.what();
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("only 1 of the 2 ranks (WORLD_SIZE) came"),
        std::string::npos)
        << e.what();
    expect_no_backtrace(e);
  }
  const std::chrono::duration<double> took =
      std::chrono::steady_clock::now() - start;
  EXPECT_LT(took.count(), 5.0);
}

TEST(JoinTest, AMalformedVariableIsAValueErrorWithoutABacktrace) {
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", "29x"},
       {"RANK", "0"},
       {"WORLD_SIZE", "2"}});
  try {
    dist::init_from_env(std::chrono::milliseconds(1500));
    ADD_FAILURE() << "MASTER_PORT=29x was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "expects MASTER_PORT to be an integer in [1, 65535], but got "
            "'29x'"),
        std::string::npos)
        << e.what();
    expect_no_backtrace(e);
  }
}

// Variables were read with strtoll and strtod: a leading space or '+' was
// taken and a trailing space refused, an empty variable read as "not set"
// (GPIPE_DIST_TIMEOUT's as its default), and an exponent was a timeout.
TEST(JoinTest, VariablesAreReadAsPlainNumbersAndEmptyOnesRefused) {
  auto error_with = [](const std::map<std::string, std::string>& vars) {
    std::map<std::string, std::string> all{
        {"MASTER_ADDR", "127.0.0.1"},
        {"MASTER_PORT", "29x"},
        {"RANK", "0"},
        {"WORLD_SIZE", "2"}};
    for (const auto& [k, v] : vars) {
      all[k] = v;
    }
    Environment env(all);
    try {
      dist::init_from_env(std::chrono::milliseconds(1500));
    } catch (const c10::ValueError& e) {
      return std::string(e.what());
    } catch (const c10::Error& e) {
      return "not a ValueError: " + std::string(e.what());
    }
    return std::string("no error");
  };
  for (const auto* port : {" 29701", "+29701", "29701 "}) {
    EXPECT_NE(
        error_with({{"MASTER_PORT", port}})
            .find(
                "expects MASTER_PORT to be an integer in [1, 65535], but got "
                "'" +
                std::string(port) + "'"),
        std::string::npos)
        << port;
  }
  EXPECT_NE(
      error_with({{"MASTER_PORT", "1"}, {"RANK", " 0"}})
          .find("expects RANK to be an integer in [0, 1], but got ' 0'"),
      std::string::npos);
  EXPECT_NE(
      error_with({{"MASTER_PORT", ""}})
          .find("MASTER_PORT is set but empty; give it a value or unset it"),
      std::string::npos);
  EXPECT_NE(
      error_with({{"MASTER_PORT", "1"}, {"LOCAL_RANK", ""}})
          .find("LOCAL_RANK is set but empty"),
      std::string::npos);
  for (const auto* timeout : {"", " 5", "1e3", "5s"}) {
    Environment env(
        std::map<std::string, std::string>{{"GPIPE_DIST_TIMEOUT", timeout}});
    const auto message =
        gpipe::testing::error_of([] { dist::default_timeout(); });
    EXPECT_NE(message.find("GPIPE_DIST_TIMEOUT"), std::string::npos)
        << "'" << timeout << "': " << message;
  }
  Environment fraction(
      std::map<std::string, std::string>{{"GPIPE_DIST_TIMEOUT", "2.5"}});
  EXPECT_EQ(dist::default_timeout(), std::chrono::milliseconds(2500));
}

// A port that accepts connections and never answers (another service, or
// rank 0's process stopped): the joining rank gave up only when killed,
// waiting in c10d's receive without a limit.
TEST(JoinTest, AStoreThatNeverAnswersEndsWithinTheTimeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), length), 0);
  ASSERT_EQ(
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  // The kernel completes connections to a listening socket by itself; this
  // one never reads or writes.
  ASSERT_EQ(::listen(fd, 16), 0);
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", std::to_string(ntohs(address.sin_port))},
       {"RANK", "1"},
       {"WORLD_SIZE", "2"},
       {"LOCAL_RANK", "0"},
       {"LOCAL_WORLD_SIZE", "1"}});
  const auto start = std::chrono::steady_clock::now();
  try {
    dist::init_from_env(std::chrono::milliseconds(2000));
    ADD_FAILURE() << "rank 1 joined a port where nothing answers";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("but no store answered there"),
        std::string::npos)
        << e.what();
    expect_no_backtrace(e);
  }
  const std::chrono::duration<double> took =
      std::chrono::steady_clock::now() - start;
  EXPECT_LT(took.count(), 6.0);
  ::close(fd);
}

// A rank whose rank 0 never came printed two lines of c10d's log before
// gpipe's error (glog's "Logging before InitGoogleLogging()" and c10d's "The
// client socket has timed out"), which carries c10d's words already.
TEST(JoinTest, ARankThatCannotReachTheStoreWritesNoLogLinesOfC10d) {
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", std::to_string(free_port())},
       {"RANK", "1"},
       {"WORLD_SIZE", "2"},
       {"LOCAL_RANK", "0"},
       {"LOCAL_WORLD_SIZE", "1"}});
  ::testing::internal::CaptureStderr();
  std::string what;
  try {
    dist::init_from_env(std::chrono::milliseconds(1000));
    ADD_FAILURE() << "rank 1 joined with nobody at the port";
  } catch (const c10::Error& e) {
    what = e.what();
  }
  const auto logged = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(what.find("could not reach rank 0's store"), std::string::npos)
      << what;
  // Nor c10d's own timeout beside gpipe's ("within 1 s [c10d: The client
  // socket has timed out after 0s ...]").
  EXPECT_EQ(what.find("timed out after"), std::string::npos) << what;
  EXPECT_EQ(logged.find("[c10d]"), std::string::npos) << logged;
  EXPECT_EQ(logged.find("InitGoogleLogging"), std::string::npos) << logged;
}

// A timeout under a second failed at once, even for a job of one rank
// (c10d's store counts its connect timeout in whole seconds): refused as
// such. GPIPE_DIST_TIMEOUT's errors carry no backtrace either.
TEST(JoinTest, ATimeoutUnderASecondIsRefused) {
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", std::to_string(free_port())},
       {"RANK", "0"},
       {"WORLD_SIZE", "1"}});
  try {
    dist::init_from_env(std::chrono::milliseconds(900));
    ADD_FAILURE() << "a 0.9 s timeout was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("expects a timeout of at least 1 s, but "
                                   "got 900 ms"),
        std::string::npos)
        << e.what();
    expect_no_backtrace(e);
  }
  for (const char* value : {"0.5", "abc", "-5", "1e20"}) {
    Environment timeout(
        std::map<std::string, std::string>{{"GPIPE_DIST_TIMEOUT", value}});
    try {
      dist::init_from_env();
      ADD_FAILURE() << "GPIPE_DIST_TIMEOUT=" << value << " was taken";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(
          std::string(e.what()).find(
              "GPIPE_DIST_TIMEOUT expects a number of seconds in [1, "
              "604800], but got '" +
              std::string(value) + "'"),
          std::string::npos)
          << e.what();
      expect_no_backtrace(e);
    }
  }
}

// A World that failed keeps its store, and so rank 0's port, until the
// process exits (dist.h). A new World on the same port in that process used
// to be told that "two processes came as RANK 0": it met its own old store.
// It is told what holds the port.
TEST(JoinTest, ANewWorldOnThePortOfAFailedWorldOfThisProcessSaysSo) {
  const auto port = std::to_string(free_port());
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", port},
       {"RANK", "0"},
       {"WORLD_SIZE", "1"}});
  {
    auto world = dist::init_from_env(std::chrono::seconds(5));
    world.connection()->fail("a failure for the test");
  }
  try {
    dist::init_from_env(std::chrono::seconds(5));
    ADD_FAILURE() << "a second World took port " << port;
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find(
            "rank 0 cannot listen on port " + port +
            ": a World of this process holds it (a World that failed "
            "keeps its store until the process exits)"),
        std::string::npos)
        << what;
    EXPECT_EQ(what.find("two processes came as RANK 0"), std::string::npos)
        << what;
    expect_no_backtrace(e);
  }
}

// A process that comes as the same RANK to a store it met before (a second
// World on the port of a first whose store rank 0's process still holds)
// was told that "two processes came as RANK 1".
TEST(JoinTest, AProcessThatComesToTheSameStoreAgainIsToldSo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto deadline = [] {
    return std::chrono::steady_clock::now() + std::chrono::seconds(10);
  };
  std::thread rank0([&] {
    dist::detail::meet(
        store, 0, 2, "here:1", deadline(), std::chrono::seconds(10), true);
  });
  dist::detail::meet(
      store, 1, 2, "here:1", deadline(), std::chrono::seconds(10), false);
  rank0.join();
  try {
    dist::detail::meet(
        store, 1, 2, "here:1", deadline(), std::chrono::seconds(10), false);
    ADD_FAILURE() << "rank 1 met the old store again";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find("this process came as RANK 1 of 2 to the store at here:1 "
                  "before"),
        std::string::npos)
        << what;
    EXPECT_EQ(what.find("two processes"), std::string::npos) << what;
  }
}

// Threads of this process just now.
int64_t threads_now() {
  int64_t n = 0;
  if (auto* dir = ::opendir("/proc/self/task")) {
    while (auto* entry = ::readdir(dir)) {
      n += entry->d_name[0] != '.';
    }
    ::closedir(dir);
  }
  return n;
}

// A World that closed cleanly kept rank 0's store alive for good (a weak
// pointer held it): its server's thread and sockets piled up World after
// World, and a new World on its port was told another process held it.
// The store now serves until the next World is made (Note [Knowing which
// ports this process hosts]).
TEST(JoinTest, WorldsMadeOneAfterAnotherTakeThePortAndLeaveNoThreads) {
  const auto port = std::to_string(free_port());
  Environment env(
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", port},
       {"RANK", "0"},
       {"WORLD_SIZE", "1"}});
  int64_t after_first = 0;
  for (int round = 0; round < 3; ++round) {
    {
      auto world = dist::init_from_env(std::chrono::seconds(5));
      world.barrier();
    }
    if (round == 0) {
      after_first = threads_now();
    }
  }
  EXPECT_EQ(threads_now(), after_first);
}

}  // namespace
}  // namespace gpipe
