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
// `pipe_write` (non-blocking) for each, ignores SIGPIPE, and unblocks them
// (a caller may have blocked them). SIGHUP and SIGINT stay ignored when
// they were ignored at the start (`nohup`, a background job of a script),
// as POSIX asks of a program that catches them; SIGTERM and SIGCHLD are
// always handled. Call once.
void install_signal_handlers(int pipe_write);

// The exit status of a rank whose program cannot be executed, as in sh.
constexpr int kCannotExecute = 127;

// The signals that gpipe-run handles. A rank gets them back, and SIGPIPE,
// with the actions that gpipe-run got (ignored stays ignored, the others
// default), and unblocked (see exec_rank).
constexpr int kHandledSignals[] = {SIGCHLD, SIGHUP, SIGINT, SIGTERM};

/// The environment of this host's rank `local_rank`: gpipe-run's own, less
/// any variables that it sets (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, GPIPE_RESTART_COUNT and
/// TORCHELASTIC_RESTART_COUNT: `restart`) and torchrun's others (see
/// kTorchrunOnly in run_spawn.cpp), plus those it sets.
std::vector<std::string> rank_environment(
    const Args& args, int port, int64_t local_rank, int64_t restart);

/// kHandledSignals as a set.
sigset_t handled_set();

// What a new rank's process reports on its error pipe when it cannot run
// its program: errno, and which step failed. The pipe is close-on-exec, so
// its end with nothing read means the program runs.
struct ExecError {
  int32_t error = 0;
  // 0: setting up the output; 1: executing the program.
  int32_t step = 0;
};

// Everything a new rank's process needs, made before the fork: between the
// fork and the exec it may make only async-signal-safe calls (gpipe-run
// has a writer thread; see Note [Writing the output]).
struct RankLaunch {
  // The program and its arguments, null-terminated; they point into the
  // command, which outlives the fork.
  std::vector<char*> argv;
  // The environment, null-terminated.
  std::vector<std::string> env_text;
  std::vector<char*> env;
  int null_fd = -1;
  // The write ends of the rank's stdout and stderr pipes.
  int out_fds[2] = {-1, -1};
  // The write end of the error pipe (see ExecError).
  int error_fd = -1;
  // gpipe-run: its parent.
  pid_t launcher = -1;
};

/// In the new process: its own process group, the signal actions gpipe-run
/// got, /dev/null as input, `launch.out_fds` (stdout, stderr) as output,
/// then the program. On Linux it is killed when gpipe-run's main thread
/// (which forked it) is gone, however that went. When it cannot run the
/// program it writes an ExecError to `launch.error_fd` and exits
/// kCannotExecute.
[[noreturn]] void exec_rank(RankLaunch& launch);

}  // namespace gpipe_run
