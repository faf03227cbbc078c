#pragma once

// gpipe-run's start of a rank: its environment, and what the new process
// does between fork and exec. Plain POSIX.

#include <signal.h>

#include <cstdint>
#include <string>
#include <vector>

#include "run_args.h"

namespace gpipe_run {

// What gpipe-run's signal handler writes to its self-pipe for each signal:
// its number and, for SIGCHLD, the process that ended. SIGCHLD comes as a
// child ends, so the order of these records is the order in which the
// ranks ended, which waitpid does not tell (it reports zombies in the order
// they were forked). A write of 8 bytes is atomic (less than PIPE_BUF): the
// loop reads whole records.
struct SignalRecord {
  int32_t signo = 0;
  int32_t pid = 0;
};

// Installs the handler of kHandledSignals, which writes a SignalRecord to
// `pipe_write` (non-blocking) for each, and ignores SIGPIPE. Call once.
void install_signal_handlers(int pipe_write);

// The exit status of a rank whose program cannot be executed, as in sh.
constexpr int kCannotExecute = 127;

// The signals that gpipe-run handles. A rank gets them back with their
// default actions and unblocked (see exec_rank).
constexpr int kHandledSignals[] = {SIGCHLD, SIGHUP, SIGINT, SIGTERM};

/// The environment of this host's rank `local_rank`: gpipe-run's own, less
/// any variables that it sets (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, GPIPE_RESTART_COUNT and
/// TORCHELASTIC_RESTART_COUNT: `restart`), plus those.
std::vector<std::string> rank_environment(
    const Args& args, int port, int64_t local_rank, int64_t restart);

/// kHandledSignals as a set.
sigset_t handled_set();

/// In the new process: its own process group, default signals, /dev/null
/// as input, `out_fds` (stdout, stderr) as output, then `command` with
/// `env`. On Linux it is killed when `launcher` (gpipe-run, its parent) is
/// gone, however that went. Exits kCannotExecute when the program cannot be
/// run.
[[noreturn]] void exec_rank(
    const std::vector<std::string>& command,
    std::vector<char*>& env,
    int null_fd,
    const int out_fds[2],
    pid_t launcher);

}  // namespace gpipe_run
