// gpipe-run: starts N processes of a program on this machine, ranks 0 to N-1
// of one job, with the environment that torchrun gives (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); prints their
// output lines prefixed with their rank; and stops them all when one fails.
// On host K of a job on several hosts (--nnodes, --node-rank K), the ranks
// are K*N to K*N+N-1, and every message names them so.
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
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "run_args.h"
#include "run_io.h"
#include "run_spawn.h"

namespace {

using namespace gpipe_run;
using Clock = std::chrono::steady_clock;

// Reads that drain a rank's pipe once it has exited: 16 reads of 64 KiB
// cover a pipe of Linux's largest default size (1 MiB), and keep a process
// that holds the pipe and writes on from keeping us here (the loop reads the
// rest).
constexpr int kDrainReads = 16;
// How often the loop checks whether the processes that a rank left behind
// are gone, while one holds the rank's output open (see Note [Stopping the
// ranks]).
constexpr int kLeftoverCheckMs = 100;

// Note [Stopping the ranks]
// The first rank to fail (exit code other than 0, or a signal) is reported
// on one line and decides gpipe-run's exit status; so does a SIGINT, SIGTERM
// or SIGHUP sent to gpipe-run. First by the time the ranks ended, as their
// SIGCHLDs came (see SignalRecord), not by rank number: when rank 1 fails
// and rank 0 fails because of it, both may have ended by the time gpipe-run
// looks. Either way every rank still running gets SIGTERM, sent to its
// process group so that what it started hears it too, then SIGKILL once
// --grace seconds have passed (or at once on a second SIGINT). Ranks that die
// of that SIGTERM are the stop, not failures.
//
// Every rank's output is read to its end: gpipe-run returns once every rank
// is reaped and, for each, its pipes are at their end or no process is left
// in its group (what the pipes still hold is then printed; a process outside
// the group could hold them open for ever). So the lines written after a
// rank itself ended still come out: those of a log filter it left running
// (`exec > >(tee log)`), or of a program that a wrapper script started and
// that prints on SIGTERM after the script has died. What a rank that has
// ended left in its group gets no SIGTERM (it may be the failing rank's own
// filter, still writing its last lines), but SIGKILL with the survivors at
// the deadline; with no stop under way it is waited for, as a shell waits
// for every writer of a pipe. Then the verdict, the last line: the rank that
// failed first, the ranks stopped, the ranks that failed on their own.
//
// With no stop under way, what the ranks left is waited for --grace seconds
// after the last rank ended; then it gets SIGTERM, and SIGKILL --grace
// seconds later, as in a stop: a background process that never ends
// (`sleep 600 &`) kept gpipe-run for ever, although every rank had ended
// well (the exit status stays theirs).
//
// A group is signalled only while a process is left in it (checked just
// before, with signal 0): the number of an empty group could name someone
// else's by then.
class Launcher {
 public:
  explicit Launcher(const Args& args) : args_(args) {}

  int run() {
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
    // could not start them. Each start has its own port (unless
    // --master-port fixed one), so that no rank meets a leftover of the
    // last start's rendezvous.
    for (restart_ = 0;; ++restart_) {
      const int port =
          args_.master_port > 0 ? args_.master_port : find_free_port();
      start_ranks(port);
      loop();
      report_verdict();
      const bool failed_start = exit_status() != 0;
      if (!failed_start || signal_ != 0 || launch_failed_ ||
          restart_ >= args_.max_restarts) {
        if (args_.max_restarts > 0) {
          report(
              std::string(failed_start ? "gave up" : "done") + " after " +
              std::to_string(restart_) + " of at most " +
              std::to_string(args_.max_restarts) + " restart" +
              (args_.max_restarts == 1 ? "" : "s"));
        }
        return exit_status();
      }
      report(
          "restarting every rank (restart " + std::to_string(restart_ + 1) +
          " of at most " + std::to_string(args_.max_restarts) + ")");
      ranks_.clear();
      stopping_ = false;
      leftovers_only_ = false;
      leftovers_since_.reset();
      killed_ = false;
      exit_order_.clear();
      failed_rank_ = -1;
      failed_status_ = 0;
    }
  }

 private:
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
    for (int64_t local = 0; local < args_.processes; ++local) {
      if (!start_rank(ranks_[local], local, port, null_fd)) {
        break;
      }
    }
    ::close(null_fd);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  }

  // Starts this host's rank `local`; `rank.rank`, which every message
  // names, is its global rank.
  bool start_rank(Rank& rank, int64_t local, int port, int null_fd) {
    const int64_t r = global_rank(args_, local);
    rank.rank = r;
    rank.prefix = "[" + std::to_string(r) + "] ";
    auto env_text = rank_environment(args_, port, local, restart_);
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
    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      exec_rank(args_.command, env, null_fd, write_ends, launcher);
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

  // Until every rank is reaped and its output read to its end (Note
  // [Stopping the ranks]).
  void loop() {
    std::vector<pollfd> fds;
    std::vector<Stream*> owners;
    std::vector<const Rank*> owner_ranks;
    while (any_running() || any_output_left()) {
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
      if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0 &&
          errno != EINTR) {
        fail_system("poll failed");
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) {
          read_stream(*owner_ranks[i], *owners[i], /*reads=*/1);
        }
      }
      // Whatever poll said: SIGCHLDs that came while the output was
      // printed (a slow stdout) must be in exit_order_ for reap().
      read_signals();
      reap();
      close_abandoned_output();
      end_leftovers();
      if (stopping_ && !killed_ && Clock::now() >= deadline_) {
        kill_survivors(
            "still running " + format_seconds(args_.grace_seconds) +
            " after SIGTERM");
      }
    }
  }

  int poll_timeout_ms() const {
    int timeout_ms = -1;
    if (stopping_ && !killed_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline_ - Clock::now());
      // Rounded up, so that the loop does not spin on a deadline less than
      // a millisecond away.
      timeout_ms = static_cast<int>(std::max<int64_t>(0, left.count() + 1));
    }
    // No signal says when what a rank left behind is gone.
    if (any_output_left()) {
      timeout_ms = timeout_ms < 0 ? kLeftoverCheckMs
                                  : std::min(timeout_ms, kLeftoverCheckMs);
    }
    return timeout_ms;
  }

  void read_signals() {
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
        report("got " + signal_name(signo) + "; sending SIGTERM to every rank");
        stop();
      } else if (!killed_ && signo == SIGINT) {
        kill_survivors("got SIGINT again");
      }
    }
  }

  // Collects every rank that has ended, in the order in which they ended
  // (as far as the SIGCHLDs tell), before looking at any: the first to have
  // failed before the stop is reported, after its last lines, and ranks
  // that ended with it are not counted as stopped.
  void reap() {
    std::vector<Rank*> ended;
    for (Rank* rank : in_exit_order()) {
      int status = 0;
      if (rank->running &&
          ::waitpid(rank->pid, &status, WNOHANG) == rank->pid) {
        rank->running = false;
        rank->status = status;
        ended.push_back(rank);
      }
    }
    exit_order_.clear();
    for (Rank* rank : ended) {
      for (auto& stream : rank->streams) {
        read_stream(*rank, stream, kDrainReads);
      }
      if (failed(rank->status) && !stopping_) {
        failed_rank_ = rank->rank;
        failed_status_ = rank->status;
        // With no other rank to stop, the verdict says it alone.
        if (any_running()) {
          report(
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
  std::vector<Rank*> in_exit_order() {
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
  // is no part of the rank.
  void close_abandoned_output() {
    for (auto& rank : ranks_) {
      if (!output_left(rank) || group_alive(rank)) {
        continue;
      }
      for (auto& stream : rank.streams) {
        read_stream(rank, stream, kDrainReads);
        if (stream.fd >= 0) {
          print_lines(rank, stream, nullptr, 0, /*flush=*/true);
          ::close(stream.fd);
          stream.fd = -1;
        }
      }
    }
  }

  // See Note [Stopping the ranks]: what the ranks left, once they have all
  // ended well, after the grace period.
  void end_leftovers() {
    if (stopping_ || any_running() || !any_output_left()) {
      return;
    }
    const auto now = Clock::now();
    if (!leftovers_since_) {
      leftovers_since_ = now;
      return;
    }
    if (now - *leftovers_since_ < grace()) {
      return;
    }
    std::vector<int64_t> left;
    for (const auto& rank : ranks_) {
      if (output_left(rank) && group_alive(rank)) {
        left.push_back(rank.rank);
      }
    }
    if (left.empty()) {
      return;  // close_abandoned_output() closes it on the next turn
    }
    report(
        ranks_phrase(left) + " ended " + format_seconds(args_.grace_seconds) +
        " ago, but what " + (left.size() == 1 ? "it" : "they") +
        " left still holds " + (left.size() == 1 ? "its" : "their") +
        " output; sending it SIGTERM");
    stopping_ = true;
    leftovers_only_ = true;
    deadline_ = now + grace();
    signal_ranks(SIGTERM, /*leftovers=*/true);
  }

  Clock::duration grace() const {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(args_.grace_seconds));
  }

  // "rank 3", "ranks 0, 2".
  static std::string ranks_phrase(const std::vector<int64_t>& ranks) {
    std::string out = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t k = 0; k < ranks.size(); ++k) {
      out += (k == 0 ? "" : ", ") + std::to_string(ranks[k]);
    }
    return out;
  }

  // SIGTERM to every running rank's group; SIGKILL after the grace period.
  void stop() {
    if (stopping_) {
      return;
    }
    stopping_ = true;
    deadline_ = Clock::now() + grace();
    for (auto& rank : ranks_) {
      rank.stopped = rank.running;
    }
    signal_ranks(SIGTERM, /*leftovers=*/false);
  }

  // SIGKILL to the ranks still running and to what the others left in
  // their groups holding their output.
  void kill_survivors(const std::string& why) {
    killed_ = true;
    std::vector<int64_t> running;
    std::vector<int64_t> left;
    for (const auto& rank : ranks_) {
      if (rank.running) {
        running.push_back(rank.rank);
      } else if (output_left(rank) && group_alive(rank)) {
        left.push_back(rank.rank);
      }
    }
    if (!running.empty() || !left.empty()) {
      report(
          why + "; sending SIGKILL to " +
          (running.empty() ? "" : ranks_phrase(running)) +
          (!running.empty() && !left.empty() ? " and " : "") +
          (left.empty() ? "" : "what " + ranks_phrase(left) + " left"));
      signal_ranks(SIGKILL, /*leftovers=*/true);
    }
  }

  // `signo` to the group of every running rank and, with `leftovers`, of
  // every rank that has ended but left a process holding its output.
  void signal_ranks(int signo, bool leftovers) {
    for (const auto& rank : ranks_) {
      if (rank.running) {
        // A rank not reaped yet still leads its group, even as a zombie.
        if (::kill(-rank.pid, signo) != 0) {
          ::kill(rank.pid, signo);
        }
      } else if (leftovers && output_left(rank) && group_alive(rank)) {
        ::kill(-rank.pid, signo);
      }
    }
  }

  // The last line, once every rank's output is out: the rank that failed
  // first (or the signal), those that failed on their own after it, and
  // those the stop ended.
  void report_verdict() const {
    if (!stopping_ || launch_failed_ || leftovers_only_) {
      return;
    }
    std::string verdict = "got " + signal_name(signal_);
    if (failed_rank_ >= 0) {
      verdict = "rank " + std::to_string(failed_rank_) + " failed" +
                (ranks_.size() > 1 ? " first" : "") + " (" +
                describe_status(failed_status_) + ")";
    }
    std::vector<int64_t> stopped;
    for (const auto& rank : ranks_) {
      if (rank.pid <= 0 || rank.rank == failed_rank_) {
        continue;
      }
      if (rank.stopped) {
        stopped.push_back(rank.rank);
      } else if (failed(rank.status)) {
        verdict += "; rank " + std::to_string(rank.rank) + " " +
                   describe_status(rank.status) + " too";
      }
    }
    if (!stopped.empty()) {
      verdict += "; stopped " + ranks_phrase(stopped);
    }
    report(verdict);
  }

  // Whether a process is left in the group that `rank` leads (a zombie
  // leader counts).
  static bool group_alive(const Rank& rank) {
    return rank.pid > 0 && (::kill(-rank.pid, 0) == 0 || errno == EPERM);
  }

  // Whether `rank` has ended but its output is not at its end yet.
  static bool output_left(const Rank& rank) {
    return !rank.running && rank.pid > 0 &&
           (rank.streams[0].fd >= 0 || rank.streams[1].fd >= 0);
  }

  bool any_output_left() const {
    return std::any_of(ranks_.begin(), ranks_.end(), output_left);
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

  const Args& args_;
  std::vector<Rank> ranks_;
  int signal_read_ = -1;
  bool stopping_ = false;
  // The stop is of what the ranks left after ending well.
  bool leftovers_only_ = false;
  std::optional<Clock::time_point> leftovers_since_;
  bool killed_ = false;
  Clock::time_point deadline_;
  bool launch_failed_ = false;
  // The processes whose SIGCHLD has come since the last reap(), in order.
  std::vector<pid_t> exit_order_;
  int64_t failed_rank_ = -1;
  int failed_status_ = 0;
  // The signal that gpipe-run got, if that is what stopped the ranks.
  int signal_ = 0;
  // Which start of the ranks this is (0: the first).
  int64_t restart_ = 0;
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
