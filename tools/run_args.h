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

// The most hosts --nnodes may name: with kMaxProcesses on each, WORLD_SIZE
// stays within the 2^20 ranks that gpipe::dist::init_from_env accepts.
constexpr int64_t kMaxNodes = 4096;

// How long ranks get between SIGTERM and SIGKILL unless --grace says, and
// the most it may say (an hour; far more would overflow the clock).
constexpr double kDefaultGraceSeconds = 5.0;
constexpr double kMaxGraceSeconds = 3600.0;

// The most --max-restarts may say.
constexpr int64_t kMaxRestarts = 1000;

struct Args {
  // The ranks on this host (-n): LOCAL_WORLD_SIZE.
  int64_t processes = 0;
  // The hosts of the job (--nnodes), each starting `processes` ranks, and
  // this host's index among them (--node-rank): its ranks are
  // node_rank * processes to node_rank * processes + processes - 1 of
  // nnodes * processes.
  int64_t nnodes = 1;
  int64_t node_rank = 0;
  std::string master_addr = "127.0.0.1";
  // 0: pick a free port at run time (only with nnodes 1).
  int master_port = 0;
  double grace_seconds = kDefaultGraceSeconds;
  // How many times every rank is started again after a rank failed
  // (--max-restarts); each start's ranks get GPIPE_RESTART_COUNT.
  int64_t max_restarts = 0;
  // The program and its arguments: everything after the first `--`.
  std::vector<std::string> command;
};

/// The usage line that --help and the usage errors show.
constexpr const char* kUsage = "gpipe-run -n N [OPTIONS] -- PROGRAM [ARGS...]";

/// Reads argv into Args; throws UsageError for a bad command line. Returns
/// false, having printed the help on stdout, for --help.
bool parse_args(int argc, const char* const* argv, Args& args);

/// The global rank (RANK) of this host's rank `local` (LOCAL_RANK).
inline int64_t global_rank(const Args& args, int64_t local) {
  return args.node_rank * args.processes + local;
}

/// WORLD_SIZE: the ranks on every host together.
inline int64_t world_size(const Args& args) {
  return args.nnodes * args.processes;
}

}  // namespace gpipe_run
