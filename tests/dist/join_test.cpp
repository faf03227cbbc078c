// Joining a job from the environment (init_from_env): its refusals are
// c10::Errors of the kind that fits, whose what() is the message alone,
// without LibTorch's backtrace (Note [Errors without LibTorch's backtrace]
// in src/text.h), and a rank left alone gives up within its timeout.

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

}  // namespace
}  // namespace gpipe
