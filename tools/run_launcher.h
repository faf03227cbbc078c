#pragma once

// gpipe-run's Launcher: starts the ranks, reads their output, reaps them,
// and stops them (run_launcher.cpp: the starts and the loop;
// run_stop.cpp: the stop and the verdict, see Note [Stopping the ranks]).
// Every member is the loop's thread's.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "run_args.h"
#include "run_io.h"
#include "run_output.h"
#include "run_spawn.h"
#include "run_watchdog.h"

namespace gpipe_run {

class Launcher {
 public:
  using Clock = std::chrono::steady_clock;

  Launcher(const Args& args, Output& output, Watchdog& watchdog)
      : args_(args), output_(output), watchdog_(watchdog) {}

  /// Starts the ranks (again, with --max-restarts) until the job ends;
  /// returns gpipe-run's exit status. What is printed may still be queued.
  int run();
  /// Waits until the output queued is written, still acting on signals.
  /// Returns nullopt once it is, or the exit status to leave with at once,
  /// leaving what is queued: a signal came, or the job was stopped by a
  /// signal and the output was not out --grace seconds later.
  std::optional<int> drain_output(int status);

 private:
  // run_launcher.cpp: the starts and the loop.
  void start_ranks(int port);
  bool start_rank(Rank& rank, int64_t local, int port, int null_fd);
  bool await_exec(Rank& rank, int error_read);
  bool give_up(
      const std::string& what, int status, const Rank* failed = nullptr);
  void loop();
  int poll_timeout_ms() const;
  void read_signals();
  void reap();
  std::vector<Rank*> in_exit_order();
  void close_abandoned_output();
  void forget_empty_groups();
  void reset_for_restart();

  // run_stop.cpp: the stop and the verdict.
  void end_leftovers();
  Clock::duration grace() const;
  static std::string ranks_phrase(const std::vector<int64_t>& ranks);
  void stop();
  void kill_survivors(const std::string& why);
  void signal_ranks(int signo, bool leftovers);
  void report_verdict() const;
  static bool group_alive(const Rank& rank);
  static bool output_left(const Rank& rank);
  bool any_output_left() const;
  bool any_running() const;
  int exit_status() const;

  const Args& args_;
  Output& output_;
  Watchdog& watchdog_;
  std::vector<Rank> ranks_;
  // The process groups of reaped ranks that still held a process when they
  // were reaped: the watchdog forgets each once it is empty.
  std::vector<pid_t> ended_groups_;
  int signal_read_ = -1;
  bool stopping_ = false;
  // The stop is of what the ranks left after ending well.
  bool leftovers_only_ = false;
  std::optional<Clock::time_point> leftovers_since_;
  bool killed_ = false;
  Clock::time_point deadline_;
  // gpipe-run's exit status when it could not start a rank (1, or
  // kCannotExecute); 0 when every start went well.
  int launch_status_ = 0;
  // The processes whose SIGCHLD has come since the last reap(), in order.
  std::vector<pid_t> exit_order_;
  int64_t failed_rank_ = -1;
  int failed_status_ = 0;
  // Ranks that ended well while others ran, before any failed: a rank whose
  // peers then fail for want of it (their errors can only say that a
  // connection closed), named in the verdict.
  std::vector<int64_t> ended_early_;
  // The signal that gpipe-run got, if that is what stopped the ranks.
  int signal_ = 0;
  // Which start of the ranks this is (0: the first).
  int64_t restart_ = 0;
};

}  // namespace gpipe_run
