#pragma once

// gpipe-run's command line: its flags and their checks (a bad command line is
// one line on stderr and exit status 2). Plain C++17 and CLI11: gpipe-run
// links no LibTorch, so that it builds in seconds.

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe_run {

// A bad command line: printed on one line, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws a UsageError made of `args` unless `condition` holds. Every message
// starts with the flag or the part of the command line it is about.
template <typename... Args>
void usage_check(bool condition, const Args&... args) {
  if (!condition) {
    std::ostringstream message;
    (message << ... << args);
    throw UsageError(message.str());
  }
}

// The exit status of a bad command line, as for most Unix tools.
constexpr int kUsageExit = 2;

// Each rank holds two pipes open in gpipe-run, so 256 ranks stay well under
// the usual limit of 1024 open files; more processes than that on one
// machine is a typo.
constexpr int64_t kMaxProcesses = 256;

// How long ranks get between SIGTERM and SIGKILL unless --grace says, and
// the most it may say (an hour; far more would overflow the clock).
constexpr double kDefaultGraceSeconds = 5.0;
constexpr double kMaxGraceSeconds = 3600.0;

struct Args {
  int64_t processes = 0;
  std::string master_addr = "127.0.0.1";
  // 0: pick a free port at run time.
  int master_port = 0;
  double grace_seconds = kDefaultGraceSeconds;
  // The program and its arguments: everything after the first `--`.
  std::vector<std::string> command;
};

/// The usage line that --help and the usage errors show.
constexpr const char* kUsage = "gpipe-run -n N [OPTIONS] -- PROGRAM [ARGS...]";

/// Reads argv into Args; throws UsageError for a bad command line. Returns
/// false, having printed the help on stdout, for --help.
bool parse_args(int argc, const char* const* argv, Args& args);

}  // namespace gpipe_run
