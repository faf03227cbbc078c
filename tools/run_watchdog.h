#pragma once

// gpipe-run's watchdog: a small process that sends SIGKILL to the ranks'
// process groups when gpipe-run dies without saying it is done (SIGKILL, a
// crash). See Note [The watchdog] in run_watchdog.cpp.

#include <sys/types.h>

namespace gpipe_run {

class Watchdog {
 public:
  /// Forks the watchdog. Call before gpipe-run starts any thread.
  Watchdog();
  /// Closes its pipe and waits for it to exit. Without finish() first (an
  /// exception ends gpipe-run), it kills every group listed, as when
  /// gpipe-run dies.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// A rank's process group, to kill should gpipe-run die.
  void watch(pid_t group);
  /// A group that is gone: its rank is reaped and no process is left in
  /// it, so that its number may name someone else's group from now on.
  void forget(pid_t group);
  /// Nothing is to be killed: gpipe-run ends normally. Waits for the
  /// watchdog to exit.
  void finish();

 private:
  void send(int op, pid_t group);

  // -1 once it has exited.
  pid_t pid_ = -1;
  // The write end of the watchdog's pipe; only gpipe-run holds it.
  int pipe_write_ = -1;
};

}  // namespace gpipe_run
