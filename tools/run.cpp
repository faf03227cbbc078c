// gpipe-run: starts N processes of a program on this machine, ranks 0 to N-1
// of one job, with the environment that torchrun gives (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); prints their
// output lines prefixed with their rank; and stops them all when one fails.
//
//   gpipe-run -n 2 -- ./my_program --its-flags
//
// Plain C++17 and POSIX, no LibTorch: one thread, which owns every piece of
// state below, and one poll() loop over the ranks' pipes and a self-pipe
// that the signal handlers write to.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "run_args.h"
#include "run_io.h"

extern char** environ;

namespace {

using namespace gpipe_run;
using Clock = std::chrono::steady_clock;

// Reads that drain a rank's pipe once it has exited: 16 reads of 64 KiB
// cover a pipe of Linux's largest default size (1 MiB), and keep a
// grandchild that holds the pipe and writes on from keeping us here.
constexpr int kDrainReads = 16;
// The exit status of a rank whose program cannot be executed, as in sh.
constexpr int kCannotExecute = 127;

// The write end of the self-pipe. A signal handler can reach only static
// storage, so this one descriptor is global; main writes it once, before any
// handler is installed.
int signal_pipe_write = -1;

void on_signal(int signo) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(signo);
  // Non-blocking: when the pipe is full, the bytes already in it wake the
  // loop all the same.
  [[maybe_unused]] const auto ignored = ::write(signal_pipe_write, &byte, 1);
  errno = saved;
}

// The environment of rank `rank`: gpipe-run's own, less any variables that
// it sets, plus those.
std::vector<std::string> rank_environment(
    const Args& args, int port, int64_t rank) {
  const std::pair<const char*, std::string> ours[] = {
      {"MASTER_ADDR", args.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(args.processes)},
      {"LOCAL_RANK", std::to_string(rank)},
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

// The signals that gpipe-run handles. A rank gets them back with their
// default actions and unblocked (see exec_rank).
const int kHandledSignals[] = {SIGCHLD, SIGHUP, SIGINT, SIGTERM};

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
    const int out_fds[2]) {
  ::setpgid(0, 0);
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

// Note [Stopping the ranks]
// The first rank to fail (exit code other than 0, or a signal) is reported
// on one line and decides gpipe-run's exit status; so does a SIGINT, SIGTERM
// or SIGHUP sent to gpipe-run. Either way every rank still running gets
// SIGTERM, sent to its process group so that what it started hears it too,
// then SIGKILL once --grace seconds have passed (or at once on a second
// SIGINT). Ranks that die of that SIGTERM are the stop, not failures, and are
// not reported. Ranks that have exited are not signalled: with no process
// left in their group, the number could name someone else's group by then.
// gpipe-run returns once every rank is reaped, having printed what they
// wrote; it does not wait for the end of their pipes, which a grandchild
// left running could hold open for ever.
class Launcher {
 public:
  explicit Launcher(const Args& args) : args_(args) {}

  int run() {
    const int port =
        args_.master_port > 0 ? args_.master_port : find_free_port();
    int self_pipe[2];
    if (!make_pipe(self_pipe)) {
      fail_system("cannot create a pipe");
    }
    set_non_blocking(self_pipe[0]);
    set_non_blocking(self_pipe[1]);
    signal_read_ = self_pipe[0];
    signal_pipe_write = self_pipe[1];
    install_handlers();
    start_ranks(port);
    loop();
    for (auto& rank : ranks_) {
      for (auto& stream : rank.streams) {
        read_stream(rank, stream, kDrainReads);
        if (stream.fd >= 0) {
          print_lines(rank, stream, nullptr, 0, /*flush=*/true);
          ::close(stream.fd);
        }
      }
    }
    return exit_status();
  }

 private:
  void install_handlers() {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (const int signo : kHandledSignals) {
      action.sa_flags = SA_RESTART | (signo == SIGCHLD ? SA_NOCLDSTOP : 0);
      ::sigaction(signo, &action, nullptr);
    }
    ::signal(SIGPIPE, SIG_IGN);
  }

  // The handled signals are blocked from before the first fork to after the
  // last: a new process must not run gpipe-run's handler (which writes to
  // gpipe-run's self-pipe) before it resets it.
  void start_ranks(int port) {
    const sigset_t handled = handled_set();
    sigset_t previous;
    ::sigprocmask(SIG_BLOCK, &handled, &previous);
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0) {
      fail_system("cannot open /dev/null");
    }
    ranks_.resize(static_cast<size_t>(args_.processes));
    for (int64_t r = 0; r < args_.processes; ++r) {
      if (!start_rank(ranks_[r], r, port, null_fd)) {
        break;
      }
    }
    ::close(null_fd);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  }

  bool start_rank(Rank& rank, int64_t r, int port, int null_fd) {
    rank.rank = r;
    rank.prefix = "[" + std::to_string(r) + "] ";
    auto env_text = rank_environment(args_, port, r);
    std::vector<char*> env;
    for (auto& entry : env_text) {
      env.push_back(entry.data());
    }
    env.push_back(nullptr);
    int out[2];
    int err[2];
    if (!make_pipe(out) || !make_pipe(err)) {
      // Nothing is closed: gpipe-run exits once the ranks started are gone.
      return give_up("cannot create pipes for rank " + std::to_string(r));
    }
    const int write_ends[2] = {out[1], err[1]};
    const pid_t pid = ::fork();
    if (pid == 0) {
      exec_rank(args_.command, env, null_fd, write_ends);
    }
    const int fork_error = errno;
    ::close(out[1]);
    ::close(err[1]);
    if (pid < 0) {
      ::close(out[0]);
      ::close(err[0]);
      errno = fork_error;
      return give_up("cannot start rank " + std::to_string(r));
    }
    // As well as in the rank: whichever runs first, the group exists before
    // gpipe-run may signal it. EACCES (the rank has exec'd already) means
    // the rank did it.
    ::setpgid(pid, pid);
    rank.pid = pid;
    rank.running = true;
    rank.streams[0].fd = out[0];
    rank.streams[0].out_fd = STDOUT_FILENO;
    rank.streams[1].fd = err[0];
    rank.streams[1].out_fd = STDERR_FILENO;
    set_non_blocking(out[0]);
    set_non_blocking(err[0]);
    return true;
  }

  bool give_up(const std::string& what) {
    report(what + ": " + errno_text(errno) + "; stopping the ranks started");
    launch_failed_ = true;
    stop();
    return false;
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<Stream*> owners;
    std::vector<const Rank*> owner_ranks;
    while (any_running()) {
      fds.assign(1, pollfd{signal_read_, POLLIN, 0});
      owners.assign(1, nullptr);
      owner_ranks.assign(1, nullptr);
      for (auto& rank : ranks_) {
        for (auto& stream : rank.streams) {
          if (stream.fd >= 0) {
            fds.push_back(pollfd{stream.fd, POLLIN, 0});
            owners.push_back(&stream);
            owner_ranks.push_back(&rank);
          }
        }
      }
      int timeout_ms = -1;
      if (stopping_ && !killed_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline_ - Clock::now());
        // Rounded up, so that the loop does not spin on a deadline less than
        // a millisecond away.
        timeout_ms = static_cast<int>(std::max<int64_t>(0, left.count() + 1));
      }
      if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
        fail_system("poll failed");
      }
      if (fds[0].revents != 0) {
        read_signals();
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) {
          read_stream(*owner_ranks[i], *owners[i], /*reads=*/1);
        }
      }
      reap();
      if (stopping_ && !killed_ && Clock::now() >= deadline_) {
        kill_survivors(
            "still running " + format_seconds(args_.grace_seconds) +
            " after SIGTERM");
      }
    }
  }

  void read_signals() {
    unsigned char bytes[64];
    ssize_t n = 0;
    while ((n = ::read(signal_read_, bytes, sizeof(bytes))) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        const int signo = bytes[i];
        if (signo == SIGCHLD) {
          continue;  // reap() runs on every turn of the loop
        }
        if (!stopping_) {
          signal_ = signo;
          report(
              "got " + signal_name(signo) + "; sending SIGTERM to every rank");
          stop();
        } else if (!killed_ && signo == SIGINT) {
          kill_survivors("got SIGINT again");
        }
      }
    }
  }

  // Collects every rank that has ended; the first to have failed before the
  // stop is reported. Its pipes are read first, so that its last lines come
  // before the report.
  void reap() {
    for (auto& rank : ranks_) {
      if (!rank.running) {
        continue;
      }
      int status = 0;
      const pid_t done = ::waitpid(rank.pid, &status, WNOHANG);
      if (done != rank.pid) {
        continue;
      }
      rank.running = false;
      for (auto& stream : rank.streams) {
        read_stream(rank, stream, kDrainReads);
      }
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (failed && !stopping_) {
        failed_rank_ = rank.rank;
        failed_status_ = status;
        report(
            "rank " + std::to_string(rank.rank) + " " +
            describe_status(status) +
            (any_running() ? "; sending SIGTERM to the other ranks" : ""));
        stop();
      }
    }
  }

  // SIGTERM to every running rank's group; SIGKILL after the grace period.
  void stop() {
    if (stopping_) {
      return;
    }
    stopping_ = true;
    deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(args_.grace_seconds));
    signal_running(SIGTERM);
  }

  void kill_survivors(const std::string& why) {
    killed_ = true;
    std::string ranks;
    for (const auto& rank : ranks_) {
      if (rank.running) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(rank.rank);
      }
    }
    if (!ranks.empty()) {
      report(why + "; sending SIGKILL to rank(s) " + ranks);
      signal_running(SIGKILL);
    }
  }

  void signal_running(int signo) {
    for (const auto& rank : ranks_) {
      // A rank not reaped yet still leads its group, even as a zombie.
      if (rank.running && ::kill(-rank.pid, signo) != 0) {
        ::kill(rank.pid, signo);
      }
    }
  }

  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& rank) {
      return rank.running;
    });
  }

  int exit_status() const {
    if (launch_failed_) {
      return 1;
    }
    if (failed_rank_ >= 0) {
      return WIFEXITED(failed_status_) ? WEXITSTATUS(failed_status_)
                                       : 128 + WTERMSIG(failed_status_);
    }
    if (signal_ != 0) {
      return 128 + signal_;
    }
    return 0;
  }

  static std::string format_seconds(double seconds) {
    std::ostringstream text;
    text << seconds << " s";
    return text.str();
  }

  const Args& args_;
  std::vector<Rank> ranks_;
  int signal_read_ = -1;
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point deadline_;
  bool launch_failed_ = false;
  int64_t failed_rank_ = -1;
  int failed_status_ = 0;
  // The signal that gpipe-run got, if that is what stopped the ranks.
  int signal_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    if (!parse_args(argc, argv, args)) {
      return 0;
    }
  } catch (const UsageError& e) {
    std::string message = e.what();
    std::replace(message.begin(), message.end(), '\n', ' ');
    report(message);
    return kUsageExit;
  }
  try {
    open_standard_fds();
    return Launcher(args).run();
  } catch (const std::exception& e) {
    report(e.what());
    return 1;
  }
}
