// gpipe-run's Launcher: the starts of the ranks and the loop (see
// run_launcher.h; the stop and the verdict are in run_stop.cpp).

#include "run_launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace gpipe_run {

namespace {

// Reads that drain a rank's pipe once it has exited: 16 reads of 64 KiB
// cover a pipe of Linux's largest default size (1 MiB), and keep a process
// that holds the pipe and writes on from keeping us here (the loop reads the
// rest).
constexpr int kDrainReads = 16;
// How often the loop checks whether the processes that a rank left behind
// are gone, while one holds the rank's output open (see Note [Stopping the
// ranks]).
constexpr int kLeftoverCheckMs = 100;
// How often it checks whether the groups of reaped ranks that still held a
// process have emptied, so that the watchdog forgets them (see Note [The
// watchdog]).
constexpr int kGroupCheckMs = 1000;

int milliseconds_until(Launcher::Clock::time_point when) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      when - Launcher::Clock::now());
  // Rounded up, so that a loop does not spin on a deadline less than a
  // millisecond away.
  return static_cast<int>(std::max<int64_t>(0, left.count() + 1));
}

}  // namespace

int Launcher::run() {
  int self_pipe[2];
  if (!make_pipe(self_pipe)) {
    fail_system("cannot create a pipe");
  }
  set_non_blocking(self_pipe[0]);
  set_non_blocking(self_pipe[1]);
  signal_read_ = self_pipe[0];
  install_signal_handlers(self_pipe[1]);
  // Note [Restarts]: a failed start is followed by another of every rank,
  // up to --max-restarts times, unless gpipe-run itself was stopped or
  // could not start them (a program that cannot be executed would fail
  // every start alike). Each start has its own port (unless --master-port
  // fixed one), so that no rank meets a leftover of the last start's
  // rendezvous. A rank that failed first with exit status 2, the status of
  // a command-line error (gpipe's tools, CLI11, argparse, the shells), is not
  // started again either: every start would read the same command line.
  for (restart_ = 0;; ++restart_) {
    const int port =
        args_.master_port > 0 ? args_.master_port : find_free_port();
    start_ranks(port);
    loop();
    report_verdict();
    const bool failed_start = exit_status() != 0;
    const bool usage_error = failed_start && launch_status_ == 0 &&
                             signal_ == 0 && failed_rank_ >= 0 &&
                             WIFEXITED(failed_status_) &&
                             WEXITSTATUS(failed_status_) == 2;
    if (usage_error && restart_ < args_.max_restarts) {
      output_.report(
          "not restarting: rank " + std::to_string(failed_rank_) +
          " exited with status 2, a command-line error that every start "
          "would repeat");
    }
    if (!failed_start || signal_ != 0 || launch_status_ != 0 || usage_error ||
        restart_ >= args_.max_restarts) {
      if (args_.max_restarts > 0 && launch_status_ == 0) {
        output_.report(
            std::string(failed_start ? "gave up" : "done") + " after " +
            std::to_string(restart_) + " of at most " +
            std::to_string(args_.max_restarts) + " restart" +
            (args_.max_restarts == 1 ? "" : "s"));
      }
      return exit_status();
    }
    output_.report(
        "restarting every rank (restart " + std::to_string(restart_ + 1) +
        " of at most " + std::to_string(args_.max_restarts) + ")");
    reset_for_restart();
  }
}

void Launcher::reset_for_restart() {
  ranks_.clear();
  stopping_ = false;
  leftovers_only_ = false;
  leftovers_since_.reset();
  killed_ = false;
  exit_order_.clear();
  failed_rank_ = -1;
  ended_early_.clear();
  failed_status_ = 0;
  forget_empty_groups();
}

std::optional<int> Launcher::drain_output(int status) {
  std::optional<Clock::time_point> deadline;
  if (signal_ != 0) {
    deadline = Clock::now() + grace();
  }
  while (!output_.empty()) {
    if (deadline && Clock::now() >= *deadline) {
      return status;
    }
    pollfd fds[2] = {
        {signal_read_, POLLIN, 0}, {output_.wakeup_fd(), POLLIN, 0}};
    if (::poll(fds, 2, deadline ? milliseconds_until(*deadline) : -1) < 0 &&
        errno != EINTR) {
      fail_system("poll failed");
    }
    output_.clear_wakeups();
    SignalRecord record;
    while (::read(signal_read_, &record, sizeof(record)) ==
           static_cast<ssize_t>(sizeof(record))) {
      if (record.signo != SIGCHLD) {
        return 128 + record.signo;
      }
    }
  }
  return std::nullopt;
}

// The handled signals are blocked from before the first fork to after the
// last: a new process must not run gpipe-run's handler (which writes to
// gpipe-run's self-pipe) before it resets it.
void Launcher::start_ranks(int port) {
  const sigset_t handled = handled_set();
  sigset_t previous;
  ::sigprocmask(SIG_BLOCK, &handled, &previous);
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) {
    fail_system("cannot open /dev/null");
  }
  ranks_.resize(static_cast<size_t>(args_.processes));
  for (int64_t local = 0; local < args_.processes; ++local) {
    if (!start_rank(ranks_[local], local, port, null_fd)) {
      break;
    }
  }
  ::close(null_fd);
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
}

// Starts this host's rank `local`; `rank.rank`, which every message
// names, is its global rank. What the new process needs is made here,
// before the fork (see RankLaunch).
bool Launcher::start_rank(Rank& rank, int64_t local, int port, int null_fd) {
  const int64_t r = global_rank(args_, local);
  rank.rank = r;
  rank.prefix = "[" + std::to_string(r) + "] ";
  RankLaunch launch;
  launch.env_text = rank_environment(args_, port, local, restart_);
  for (auto& entry : launch.env_text) {
    launch.env.push_back(entry.data());
  }
  launch.env.push_back(nullptr);
  for (const auto& arg : args_.command) {
    launch.argv.push_back(const_cast<char*>(arg.c_str()));
  }
  launch.argv.push_back(nullptr);
  launch.null_fd = null_fd;
  launch.launcher = ::getpid();
  int out[2];
  int err[2];
  int exec_error[2];
  if (!make_pipe(out) || !make_pipe(err) || !make_pipe(exec_error)) {
    // Nothing is closed: gpipe-run exits once the ranks started are gone.
    return give_up(
        "cannot create pipes for rank " + std::to_string(r) + ": " +
            errno_text(errno),
        1);
  }
  launch.out_fds[0] = out[1];
  launch.out_fds[1] = err[1];
  launch.error_fd = exec_error[1];
  const pid_t pid = ::fork();
  if (pid == 0) {
    exec_rank(launch);
  }
  const int fork_error = errno;
  ::close(out[1]);
  ::close(err[1]);
  ::close(exec_error[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    ::close(exec_error[0]);
    return give_up(
        "cannot start rank " + std::to_string(r) + ": " +
            errno_text(fork_error),
        1);
  }
  // As well as in the rank: whichever runs first, the group exists before
  // gpipe-run may signal it, or the watchdog. EACCES (the rank has exec'd
  // already) means the rank did it.
  ::setpgid(pid, pid);
  watchdog_.watch(pid);
  rank.pid = pid;
  rank.running = true;
  rank.streams[0].fd = out[0];
  rank.streams[0].out_fd = STDOUT_FILENO;
  rank.streams[1].fd = err[0];
  rank.streams[1].out_fd = STDERR_FILENO;
  set_non_blocking(out[0]);
  set_non_blocking(err[0]);
  return await_exec(rank, exec_error[0]);
}

// Waits until the new process has exec'd its program (its error pipe ends
// with nothing in it) or said why it could not (an ExecError). A program
// that cannot be executed ends the job at once, with no restart.
bool Launcher::await_exec(Rank& rank, int error_read) {
  ExecError failure;
  ssize_t n = -1;
  do {
    n = ::read(error_read, &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  ::close(error_read);
  if (n != static_cast<ssize_t>(sizeof(failure))) {
    return true;
  }
  const std::string what =
      failure.step == 1
          ? "cannot execute '" + args_.command[0] + "' for rank " +
                std::to_string(rank.rank)
          : "cannot set up the output of rank " + std::to_string(rank.rank);
  return give_up(
      what + ": " + errno_text(failure.error), kCannotExecute, &rank);
}

// Ends the job: no rank more is started, and those started (but `failed`,
// whose process is ending by itself) are stopped.
bool Launcher::give_up(
    const std::string& what, int status, const Rank* failed) {
  const bool others =
      std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& rank) {
        return rank.running && &rank != failed;
      });
  output_.report(what + (others ? "; stopping the ranks started" : ""));
  launch_status_ = status;
  stop();
  return false;
}

// Until every rank is reaped and its output read to its end (Note
// [Stopping the ranks]). The ranks' pipes are not read while the output
// queue is over its bound (Note [Writing the output]).
void Launcher::loop() {
  std::vector<pollfd> fds;
  std::vector<Stream*> owners;
  std::vector<const Rank*> owner_ranks;
  while (any_running() || any_output_left()) {
    fds.assign(
        {pollfd{signal_read_, POLLIN, 0},
         pollfd{output_.wakeup_fd(), POLLIN, 0}});
    owners.assign(2, nullptr);
    owner_ranks.assign(2, nullptr);
    if (!output_.over_bound()) {
      for (auto& rank : ranks_) {
        for (auto& stream : rank.streams) {
          if (stream.fd >= 0) {
            fds.push_back(pollfd{stream.fd, POLLIN, 0});
            owners.push_back(&stream);
            owner_ranks.push_back(&rank);
          }
        }
      }
    }
    if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0 &&
        errno != EINTR) {
      fail_system("poll failed");
    }
    output_.clear_wakeups();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents != 0) {
        read_stream(output_, *owner_ranks[i], *owners[i], /*reads=*/1);
      }
    }
    // Whatever poll said: SIGCHLDs that came while the output was read
    // must be in exit_order_ for reap().
    read_signals();
    reap();
    close_abandoned_output();
    forget_empty_groups();
    end_leftovers();
    if (stopping_ && !killed_ && Clock::now() >= deadline_) {
      kill_survivors(
          "still running " + format_seconds(args_.grace_seconds) +
          " after SIGTERM");
    }
  }
}

int Launcher::poll_timeout_ms() const {
  int timeout_ms = -1;
  const auto at_most = [&timeout_ms](int ms) {
    timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
  };
  if (stopping_ && !killed_) {
    at_most(milliseconds_until(deadline_));
  }
  // No signal says when what a rank left behind is gone.
  if (any_output_left()) {
    at_most(kLeftoverCheckMs);
  }
  if (!ended_groups_.empty()) {
    at_most(kGroupCheckMs);
  }
  return timeout_ms;
}

void Launcher::read_signals() {
  SignalRecord record;
  while (::read(signal_read_, &record, sizeof(record)) ==
         static_cast<ssize_t>(sizeof(record))) {
    const int signo = record.signo;
    if (signo == SIGCHLD) {
      exit_order_.push_back(record.pid);  // reap() runs on every turn
      continue;
    }
    if (!stopping_) {
      signal_ = signo;
      output_.report(
          "got " + signal_name(signo) + "; sending SIGTERM to every rank");
      stop();
    } else if (!killed_ && signo == SIGINT) {
      kill_survivors(
          signal_ == SIGINT ? "got SIGINT again"
          : signal_ != 0    ? "got SIGINT after " + signal_name(signal_)
                            : "got SIGINT while stopping the ranks");
    }
  }
}

// Collects every rank that has ended, in the order in which they ended
// (as far as the SIGCHLDs tell), before looking at any: the first to have
// failed before the stop is reported, after its last lines, and ranks
// that ended with it are not counted as stopped.
void Launcher::reap() {
  std::vector<Rank*> ended;
  for (Rank* rank : in_exit_order()) {
    int status = 0;
    if (rank->running && ::waitpid(rank->pid, &status, WNOHANG) == rank->pid) {
      rank->running = false;
      rank->status = status;
      ended.push_back(rank);
    }
  }
  exit_order_.clear();
  for (Rank* rank : ended) {
    // Its number is free once its group is empty too.
    if (group_alive(*rank)) {
      ended_groups_.push_back(rank->pid);
    } else {
      watchdog_.forget(rank->pid);
    }
    for (auto& stream : rank->streams) {
      read_stream(output_, *rank, stream, kDrainReads);
    }
    if (!failed(rank->status) && !stopping_ && failed_rank_ < 0 &&
        any_running()) {
      ended_early_.push_back(rank->rank);
    }
    if (failed(rank->status) && !stopping_) {
      failed_rank_ = rank->rank;
      failed_status_ = rank->status;
      // With no other rank to stop, the verdict says it alone.
      if (any_running()) {
        output_.report(
            "rank " + std::to_string(rank->rank) + " " +
            describe_status(rank->status) +
            "; sending SIGTERM to the other ranks");
      }
      stop();
    }
  }
}

// The ranks whose SIGCHLD has come, in that order, then the others by
// rank.
std::vector<Rank*> Launcher::in_exit_order() {
  std::vector<Rank*> order;
  order.reserve(ranks_.size());
  std::vector<bool> taken(ranks_.size(), false);
  for (const pid_t pid : exit_order_) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (!taken[r] && ranks_[r].pid == pid) {
        taken[r] = true;
        order.push_back(&ranks_[r]);
      }
    }
  }
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (!taken[r]) {
      order.push_back(&ranks_[r]);
    }
  }
  return order;
}

// Closes the output of the ranks that have ended and left no process in
// their group, once what it holds is printed: whoever holds it open now
// is no part of the rank. Read whatever the output queue holds: no rank's
// process can add to it any more, and waiting for a reader that does not
// read would keep gpipe-run for ever (drain_output gives up on it).
void Launcher::close_abandoned_output() {
  for (auto& rank : ranks_) {
    if (!output_left(rank) || group_alive(rank)) {
      continue;
    }
    for (auto& stream : rank.streams) {
      read_stream(output_, rank, stream, kDrainReads, /*bounded=*/false);
      if (stream.fd >= 0) {
        print_lines(output_, rank, stream, nullptr, 0, /*flush=*/true);
        ::close(stream.fd);
        stream.fd = -1;
      }
    }
  }
}

// The watchdog forgets the groups of reaped ranks once they are empty.
void Launcher::forget_empty_groups() {
  auto gone = [this](pid_t group) {
    if (::kill(-group, 0) != 0 && errno == ESRCH) {
      watchdog_.forget(group);
      return true;
    }
    return false;
  };
  ended_groups_.erase(
      std::remove_if(ended_groups_.begin(), ended_groups_.end(), gone),
      ended_groups_.end());
}

}  // namespace gpipe_run
