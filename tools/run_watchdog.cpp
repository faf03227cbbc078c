// gpipe-run's watchdog (see run_watchdog.h).

#include "run_watchdog.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "run_args.h"
#include "run_io.h"

namespace gpipe_run {

// Note [The watchdog]
// A gpipe-run killed by SIGKILL can forward nothing. Its ranks die with it
// (PR_SET_PDEATHSIG, see exec_rank), but what they started does not: a
// wrapper script's training program would write checkpoints on beside a
// restarted job. So gpipe-run forks a watchdog at its start, before any
// thread exists, and tells it through a pipe each rank's process group as
// the rank starts, and that the group is gone once the rank is reaped and
// no process is left in it (a group number that is free may be reused, and
// the watchdog must never signal someone else's group). When the pipe ends
// without a "done" (gpipe-run died: only gpipe-run holds the write end,
// close-on-exec, so no rank keeps it open), the watchdog sends SIGKILL to
// every group still listed, and exits. Processes that left their rank's
// group (setsid) are out of its reach.
//
// The watchdog is in a process group of its own, ignores SIGINT, SIGTERM
// and SIGHUP (a Ctrl-C or a `kill` of the job's group is gpipe-run's to
// handle), and holds no descriptor but its pipe: it must not keep the
// ranks' pipes or gpipe-run's stdout open (`gpipe-run | tee` ends when
// gpipe-run does). It makes only async-signal-safe calls, and keeps its
// list in a fixed array.

namespace {

// What gpipe-run writes to the watchdog's pipe: 8 bytes, less than
// PIPE_BUF, so that every write is whole.
struct WatchRecord {
  int32_t op = 0;
  int32_t group = 0;
};

constexpr int32_t kWatch = 1;
constexpr int32_t kForget = 2;
constexpr int32_t kDone = 3;

// Groups listed at once: every rank of many starts, with room for groups
// that the ranks' leftovers keep alive.
constexpr int kMaxWatched = static_cast<int>(kMaxProcesses) * 16;

// The descriptor that the watchdog reads its pipe on, once it has closed
// every other.
constexpr int kWatchdogFd = 3;

// Every descriptor but 0 to 2 (on /dev/null) and the pipe, which ends up as
// kWatchdogFd.
void keep_only_pipe(int pipe_read) {
  if (pipe_read != kWatchdogFd) {
    ::dup2(pipe_read, kWatchdogFd);
    ::close(pipe_read);
  }
  const int null_fd = ::open("/dev/null", O_RDWR);
  for (int fd = 0; fd <= 2; ++fd) {
    ::dup2(null_fd, fd);
  }
  if (null_fd > kWatchdogFd) {
    ::close(null_fd);
  }
#if defined(SYS_close_range)
  if (::syscall(SYS_close_range, kWatchdogFd + 1, ~0U, 0) == 0) {
    return;
  }
#endif
  rlimit limit{};
  int last = 1024;
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 &&
      limit.rlim_cur != RLIM_INFINITY) {
    last = static_cast<int>(limit.rlim_cur);
  }
  for (int fd = kWatchdogFd + 1; fd < last; ++fd) {
    ::close(fd);
  }
}

// Whether a process is left in `group`.
bool group_alive(pid_t group) {
  return ::kill(-group, 0) == 0 || errno == EPERM;
}

[[noreturn]] void watch_groups(int pipe_read) {
  ::setpgid(0, 0);
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
  keep_only_pipe(pipe_read);
  pid_t groups[kMaxWatched];
  int count = 0;
  WatchRecord record;
  while (true) {
    const ssize_t n = ::read(kWatchdogFd, &record, sizeof(record));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n != static_cast<ssize_t>(sizeof(record)) || record.op == kDone) {
      break;
    }
    if (record.op == kForget) {
      for (int i = 0; i < count; ++i) {
        if (groups[i] == record.group) {
          groups[i] = groups[--count];
          break;
        }
      }
      continue;
    }
    if (count == kMaxWatched) {
      // Full of leftovers: those that are gone make room.
      for (int i = count - 1; i >= 0; --i) {
        if (!group_alive(groups[i])) {
          groups[i] = groups[--count];
        }
      }
    }
    if (count < kMaxWatched) {
      groups[count++] = record.group;
    }
  }
  if (record.op != kDone) {
    for (int i = 0; i < count; ++i) {
      ::kill(-groups[i], SIGKILL);
    }
  }
  _exit(0);
}

}  // namespace

Watchdog::Watchdog() {
  int fds[2];
  if (!make_pipe(fds)) {
    fail_system("cannot create a pipe for the watchdog");
  }
  pid_ = ::fork();
  if (pid_ < 0) {
    fail_system("cannot start the watchdog");
  }
  if (pid_ == 0) {
    ::close(fds[1]);
    watch_groups(fds[0]);
  }
  ::close(fds[0]);
  pipe_write_ = fds[1];
  // A watchdog that is stopped must not stop gpipe-run with it: a record
  // that does not fit is dropped.
  set_non_blocking(pipe_write_);
}

Watchdog::~Watchdog() {
  if (pid_ > 0) {
    ::close(pipe_write_);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

void Watchdog::watch(pid_t group) {
  send(kWatch, group);
}

void Watchdog::forget(pid_t group) {
  send(kForget, group);
}

// Says "done", then waits for the watchdog to exit.
void Watchdog::finish() {
  if (pid_ > 0) {
    send(kDone, 0);
    ::close(pipe_write_);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
}

void Watchdog::send(int op, pid_t group) {
  WatchRecord record;
  record.op = op;
  record.group = static_cast<int32_t>(group);
  ssize_t n = -1;
  do {
    n = ::write(pipe_write_, &record, sizeof(record));
  } while (n < 0 && errno == EINTR);
}

}  // namespace gpipe_run
