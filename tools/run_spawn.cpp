// gpipe-run's start of a rank (see run_spawn.h).

#include "run_spawn.h"

#include <signal.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
  struct sigaction action {};
  action.sa_sigaction = on_signal;
  sigemptyset(&action.sa_mask);
  for (const int signo : kHandledSignals) {
    action.sa_flags =
        SA_SIGINFO | SA_RESTART | (signo == SIGCHLD ? SA_NOCLDSTOP : 0);
    ::sigaction(signo, &action, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);
}

// The environment of this host's rank `local_rank`: gpipe-run's own, less
// any variables that it sets, plus those.
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
    if (!replaced) {
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

// In the new process: its own process group, default signals, /dev/null as
// input, the pipes as output, then the program. Runs between fork and exec,
// which is safe for what it calls as gpipe-run is one thread.
[[noreturn]] void exec_rank(
    const std::vector<std::string>& command,
    std::vector<char*>& env,
    int null_fd,
    const int out_fds[2],
    pid_t launcher) {
  ::setpgid(0, 0);
#if defined(__linux__)
  // A launcher killed by SIGKILL forwards nothing: its ranks would train on
  // unsupervised, with no one to read their output, and a restarted job
  // beside them would write into the same checkpoints. So the kernel ends a
  // rank when gpipe-run (one thread) is gone; one that went before this
  // line is seen by the parent changing.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) {
    _exit(kCannotExecute);
  }
#else
  (void)launcher;
#endif
  // Handlers would be reset by exec anyway, but a signal could come first
  // (once unblocked below); an ignored signal and the mask survive exec.
  for (const int signo : kHandledSignals) {
    ::signal(signo, SIG_DFL);
  }
  ::signal(SIGPIPE, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  // Descriptors 0 to 2 were open before any pipe (open_standard_fds), so
  // every dup2 here makes a new descriptor, without close-on-exec; the
  // originals close at exec.
  if (::dup2(null_fd, STDIN_FILENO) < 0 ||
      ::dup2(out_fds[0], STDOUT_FILENO) < 0 ||
      ::dup2(out_fds[1], STDERR_FILENO) < 0) {
    _exit(kCannotExecute);
  }
  std::vector<char*> argv;
  for (const auto& arg : command) {
    argv.push_back(const_cast<char*>(arg.c_str()));
  }
  argv.push_back(nullptr);
  // execvp searches the PATH of `environ`: gpipe-run's own, which env keeps.
  environ = env.data();
  ::execvp(argv[0], argv.data());
  const int error = errno;
  const std::string message = "gpipe-run: cannot execute '" + command[0] +
                              "': " + errno_text(error) + "\n";
  write_all(STDERR_FILENO, message.data(), message.size());
  _exit(kCannotExecute);
}

}  // namespace gpipe_run
