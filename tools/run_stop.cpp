// gpipe-run's Launcher: the stop and the verdict (see run_launcher.h).

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>

#include "run_launcher.h"

namespace gpipe_run {

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
// failed first, the ranks stopped, the ranks that failed on their own, and
// the ranks that had exited with code 0 before it while others ran (a rank
// that leaves the job early makes its peers fail with nothing to say but
// that a connection closed; so it is named).
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
// See Note [Stopping the ranks]: what the ranks left, once they have all
// ended well, after the grace period.
void Launcher::end_leftovers() {
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
  output_.report(
      ranks_phrase(left) + " ended " + format_seconds(args_.grace_seconds) +
      " ago, but what " + (left.size() == 1 ? "it" : "they") +
      " left still holds " + (left.size() == 1 ? "its" : "their") +
      " output; sending it SIGTERM");
  stopping_ = true;
  leftovers_only_ = true;
  deadline_ = now + grace();
  signal_ranks(SIGTERM, /*leftovers=*/true);
}

Launcher::Clock::duration Launcher::grace() const {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(args_.grace_seconds));
}

// "rank 3", "ranks 0, 2".
std::string Launcher::ranks_phrase(const std::vector<int64_t>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t k = 0; k < ranks.size(); ++k) {
    out += (k == 0 ? "" : ", ") + std::to_string(ranks[k]);
  }
  return out;
}

// SIGTERM to every running rank's group; SIGKILL after the grace period.
void Launcher::stop() {
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
void Launcher::kill_survivors(const std::string& why) {
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
    output_.report(
        why + "; sending SIGKILL to " +
        (running.empty() ? "" : ranks_phrase(running)) +
        (!running.empty() && !left.empty() ? " and " : "") +
        (left.empty() ? "" : "what " + ranks_phrase(left) + " left"));
    signal_ranks(SIGKILL, /*leftovers=*/true);
  }
}

// `signo` to the group of every running rank and, with `leftovers`, of
// every rank that has ended but left a process holding its output.
void Launcher::signal_ranks(int signo, bool leftovers) {
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
void Launcher::report_verdict() const {
  if (!stopping_ || launch_status_ != 0 || leftovers_only_) {
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
  if (failed_rank_ >= 0 && !ended_early_.empty()) {
    // Their peers' errors can only say that a connection closed.
    verdict += "; before it, " + ranks_phrase(ended_early_) +
               (ended_early_.size() == 1 ? " had" : " had each") +
               " exited with code 0 while the others ran";
  }
  output_.report(verdict);
}

// Whether a process is left in the group that `rank` leads (a zombie
// leader counts).
bool Launcher::group_alive(const Rank& rank) {
  return rank.pid > 0 && (::kill(-rank.pid, 0) == 0 || errno == EPERM);
}

// Whether `rank` has ended but its output is not at its end yet.
bool Launcher::output_left(const Rank& rank) {
  return !rank.running && rank.pid > 0 &&
         (rank.streams[0].fd >= 0 || rank.streams[1].fd >= 0);
}

bool Launcher::any_output_left() const {
  return std::any_of(ranks_.begin(), ranks_.end(), output_left);
}

bool Launcher::any_running() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& rank) {
    return rank.running;
  });
}

int Launcher::exit_status() const {
  if (launch_status_ != 0) {
    return launch_status_;
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

}  // namespace gpipe_run
