// gpipe-run: starts N processes of a program on this machine, ranks 0 to N-1
// of one job, with the environment that torchrun gives (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); prints their
// output lines prefixed with their rank; and stops them all when one fails.
// On host K of a job on several hosts (--nnodes, --node-rank K), the ranks
// are K*N to K*N+N-1, and every message names them so.
//
//   gpipe-run -n 2 -- ./my_program --its-flags
//
// Plain C++17 and POSIX, no LibTorch. Two threads and one more process:
// the loop's thread owns the Launcher (run_launcher.h), whose one poll()
// loop reads the ranks' pipes and a self-pipe that the signal handlers
// write to, and forks the ranks; a writer thread writes what the loop
// prints, so that a reader that does not read never keeps the loop from
// acting on a signal (Note [Writing the output], run_output.cpp); a
// watchdog process kills what the ranks started should gpipe-run be killed
// (Note [The watchdog], run_watchdog.cpp).

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>

#include "run_args.h"
#include "run_io.h"
#include "run_launcher.h"
#include "run_output.h"
#include "run_watchdog.h"

using namespace gpipe_run;

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
    // The watchdog first: it must be forked while gpipe-run is one thread.
    Watchdog watchdog;
    Output output;
    Launcher launcher(args, output, watchdog);
    const int status = launcher.run();
    watchdog.finish();
    if (const auto now = launcher.drain_output(status)) {
      // The writer thread still waits on a reader that does not read: what
      // it holds is dropped, and neither it nor any destructor is waited
      // for. One line says so, where stderr takes it without waiting.
      report_if_writable(
          "left output unwritten: its reader does not read (exit status " +
          std::to_string(*now) + ")");
      std::_Exit(*now);
    }
    // Note [Output that could not be written] in run_output.cpp.
    if (const auto lost = output.stdout_lost(); status == 0 && !lost.empty()) {
      report_if_writable(
          "could not write the ranks' standard output (" + lost +
          "): some of it is lost");
      return 1;
    }
    return status;
  } catch (const std::exception& e) {
    // Written once the output queued before it is out (~Output).
    report(e.what());
    return 1;
  }
}
