// gpipe-run's start of a rank (see run_spawn.h).

#include "run_spawn.h"

#include <signal.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <iterator>
#include <utility>

#include "run_io.h"

extern char** environ;

namespace gpipe_run {

namespace {

// The write end of the self-pipe. A signal handler can reach only static
// storage, so this one descriptor is global; it is written once, before
// any handler is installed.
int signal_pipe_write = -1;

// The signals whose action gpipe-run passes on to its ranks: those it
// handles or ignores itself.
constexpr int kPassedOn[] = {SIGCHLD, SIGHUP, SIGINT, SIGTERM, SIGPIPE};

// Whether each of kPassedOn was ignored when gpipe-run started. Written
// once, before the first fork; the ranks' processes read it.
bool ignored_at_start[std::size(kPassedOn)] = {};

// torchrun's variables that gpipe-run does not set: a rank must not read an
// outer torchrun job's values (gpipe-run run inside one), so they are left
// out of its environment. Every TORCHELASTIC_* but the restart count goes
// too (TORCHELASTIC_RUN_ID, _MAX_RESTARTS, _USE_AGENT_STORE, _ERROR_FILE,
// ...).
constexpr const char* kTorchrunOnly[] = {
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME"};
constexpr const char* kTorchelasticPrefix = "TORCHELASTIC_";

bool torchrun_only(const std::string& name) {
  return name.rfind(kTorchelasticPrefix, 0) == 0 ||
         std::any_of(
             std::begin(kTorchrunOnly),
             std::end(kTorchrunOnly),
             [&](const char* other) { return name == other; });
}

void on_signal(int signo, siginfo_t* info, void* /*context*/) {
  const int saved = errno;
  SignalRecord record;
  record.signo = signo;
  record.pid = signo == SIGCHLD && info != nullptr ? info->si_pid : 0;
  // Non-blocking: when the pipe is full, the records already in it wake the
  // loop all the same (the record is lost; reap() then falls back to rank
  // order).
  [[maybe_unused]] const auto ignored =
      ::write(signal_pipe_write, &record, sizeof(record));
  errno = saved;
}

}  // namespace

void install_signal_handlers(int pipe_write) {
  signal_pipe_write = pipe_write;
  for (size_t i = 0; i < std::size(kPassedOn); ++i) {
    struct sigaction old {};
    ::sigaction(kPassedOn[i], nullptr, &old);
    ignored_at_start[i] = old.sa_handler == SIG_IGN;
  }
  struct sigaction action {};
  action.sa_sigaction = on_signal;
  sigemptyset(&action.sa_mask);
  for (const int signo : kHandledSignals) {
    struct sigaction old {};
    ::sigaction(signo, nullptr, &old);
    if ((signo == SIGHUP || signo == SIGINT) && old.sa_handler == SIG_IGN) {
      continue;
    }
    action.sa_flags =
        SA_SIGINFO | SA_RESTART | (signo == SIGCHLD ? SA_NOCLDSTOP : 0);
    ::sigaction(signo, &action, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);
  // Only now: a signal blocked by whoever started gpipe-run, and pending,
  // comes at once and finds the handler.
  const sigset_t handled = handled_set();
  ::sigprocmask(SIG_UNBLOCK, &handled, nullptr);
}

// The environment of this host's rank `local_rank`: gpipe-run's own, less
// any variables that it sets and torchrun's others, plus those it sets.
std::vector<std::string> rank_environment(
    const Args& args, int port, int64_t local_rank, int64_t restart) {
  const std::pair<const char*, std::string> ours[] = {
      {"GPIPE_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"MASTER_ADDR", args.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"RANK", std::to_string(global_rank(args, local_rank))},
      {"WORLD_SIZE", std::to_string(world_size(args))},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(args.processes)}};
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const std::string name = text.substr(0, text.find('='));
    const bool replaced =
        std::any_of(std::begin(ours), std::end(ours), [&](const auto& var) {
          return name == var.first;
        });
    if (!replaced && !torchrun_only(name)) {
      env.push_back(text);
    }
  }
  for (const auto& [name, value] : ours) {
    env.push_back(std::string(name) + "=" + value);
  }
  return env;
}

sigset_t handled_set() {
  sigset_t set;
  sigemptyset(&set);
  for (const int signo : kHandledSignals) {
    sigaddset(&set, signo);
  }
  return set;
}

// In the new process: its own process group, the signal actions gpipe-run
// got, /dev/null as input, the pipes as output, then the program. Runs
// between fork and exec, in a copy of a process with two threads: every
// call here is async-signal-safe (execvp is not on POSIX's list, but glibc's
// and musl's search the PATH on the stack, without malloc).
[[noreturn]] void exec_rank(RankLaunch& launch) {
  ExecError failure;
  ::setpgid(0, 0);
#if defined(__linux__)
  // A launcher killed by SIGKILL forwards nothing: its ranks would train on
  // unsupervised, with no one to read their output, and a restarted job
  // beside them would write into the same checkpoints. So the kernel ends a
  // rank when the thread that forked it (gpipe-run's main thread, which
  // lives as long as gpipe-run) is gone; one that went before this line is
  // seen by the parent changing. What the rank starts is the watchdog's
  // (see Note [The watchdog]).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launch.launcher) {
    _exit(kCannotExecute);
  }
#endif
  // Handlers would be reset by exec anyway, but a signal could come first
  // (once unblocked below); an ignored signal and the mask survive exec.
  for (size_t i = 0; i < std::size(kPassedOn); ++i) {
    ::signal(kPassedOn[i], ignored_at_start[i] ? SIG_IGN : SIG_DFL);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  // Descriptors 0 to 2 were open before any pipe (open_standard_fds), so
  // every dup2 here makes a new descriptor, without close-on-exec; the
  // originals close at exec.
  if (::dup2(launch.null_fd, STDIN_FILENO) < 0 ||
      ::dup2(launch.out_fds[0], STDOUT_FILENO) < 0 ||
      ::dup2(launch.out_fds[1], STDERR_FILENO) < 0) {
    failure.error = errno;
  } else {
    // execvp searches the PATH of `environ`: gpipe-run's own, which env
    // keeps.
    environ = launch.env.data();
    ::execvp(launch.argv[0], launch.argv.data());
    failure.error = errno;
    failure.step = 1;
  }
  [[maybe_unused]] const auto ignored =
      ::write(launch.error_fd, &failure, sizeof(failure));
  _exit(kCannotExecute);
}

}  // namespace gpipe_run
