#include "run_io.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "run_output.h"

namespace gpipe_run {

std::string errno_text(int error) {
  return std::strerror(error);
}

[[noreturn]] void fail_system(const std::string& what) {
  throw std::runtime_error(what + ": " + errno_text(errno));
}

// SIGKILL rather than "Killed": the names that people grep logs for.
std::string signal_name(int signo) {
  static const std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},
      {SIGINT, "SIGINT"},
      {SIGQUIT, "SIGQUIT"},
      {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"},
      {SIGABRT, "SIGABRT"},
      {SIGBUS, "SIGBUS"},
      {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"},
      {SIGUSR1, "SIGUSR1"},
      {SIGSEGV, "SIGSEGV"},
      {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"},
      {SIGALRM, "SIGALRM"},
      {SIGTERM, "SIGTERM"},
      {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"},
      {SIGSYS, "SIGSYS"}};
  for (const auto& [number, name] : kNames) {
    if (number == signo) {
      return name;
    }
  }
  return "signal " + std::to_string(signo);
}

// Writes all of `data` to `fd`, waiting when `fd` is non-blocking and full.
// A failed write drops the rest: a closed stdout (`gpipe-run ... | head`)
// must not stop the ranks, and SIGPIPE is ignored for that reason. Its
// errno is returned, for the writer to tell a full disk from a closed pipe
// (Note [Output that could not be written] in run_output.cpp).
int write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n >= 0) {
      data += n;
      size -= static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd out{fd, POLLOUT, 0};
      ::poll(&out, 1, -1);
    } else if (errno != EINTR) {
      return errno;
    }
  }
  return 0;
}

// gpipe-run's own messages: one line on stderr, written whole.
void report(const std::string& message) {
  const std::string line = "gpipe-run: " + message + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

// A line of less than PIPE_BUF bytes goes into a pipe whole or waits: poll
// says whether it has room for it.
void report_if_writable(const std::string& message) {
  pollfd err{STDERR_FILENO, POLLOUT, 0};
  if (::poll(&err, 1, 0) == 1 && (err.revents & POLLOUT) != 0) {
    report(message);
  }
}

// Descriptors 0 to 2 open, on /dev/null if need be. Otherwise a pipe could
// get one of those numbers, and a rank's dup2 onto it would leave it with
// close-on-exec set.
void open_standard_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int null = ::open("/dev/null", O_RDWR);
      if (null != fd) {
        fail_system(
            "cannot open /dev/null for descriptor " + std::to_string(fd));
      }
    }
  }
}

// A pipe whose ends are closed in the ranks' programs (close-on-exec), so
// that no rank holds another rank's pipe or the self-pipe open. pipe() then
// fcntl() leaves no gap for a fork, as only the loop's thread forks and
// makes pipes (pipe2 would do both at once, but is not in POSIX.1-2017).
// False, with errno, on error.
bool make_pipe(int fds[2]) {
  if (::pipe(fds) != 0) {
    return false;
  }
  ::fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  ::fcntl(fds[1], F_SETFD, FD_CLOEXEC);
  return true;
}

void set_non_blocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// A TCP port that was free a moment ago: bound as port 0 on 127.0.0.1, read
// back, closed. Another process may take it before rank 0 binds it; pass
// --master-port where that matters.
int find_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    fail_system("cannot find a free port (socket); pass --master-port");
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    ::close(fd);
    errno = error;
    fail_system("cannot find a free port; pass --master-port");
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

// Queues the whole lines in `stream.partial` plus `data`, each with the
// rank's prefix, as one write; keeps the rest. At the end of the stream,
// `flush` queues the rest as a line too.
void print_lines(
    Output& output,
    const Rank& rank,
    Stream& stream,
    const char* data,
    size_t size,
    bool flush) {
  stream.partial.append(data, size);
  std::string out;
  size_t begin = 0;
  while (true) {
    const size_t newline = stream.partial.find('\n', begin);
    size_t end = newline;
    if (newline == std::string::npos) {
      const size_t rest = stream.partial.size() - begin;
      // A piece of exactly kMaxLine waits for what follows: its newline
      // makes it a line, not a piece and then an empty line.
      if (rest == 0 || (!flush && rest <= kMaxLine)) {
        break;
      }
      end = begin + std::min(rest, kMaxLine);
    } else if (newline - begin > kMaxLine) {
      end = begin + kMaxLine;
    }
    out += rank.prefix;
    out.append(stream.partial, begin, end - begin);
    out += '\n';
    begin = end == newline ? end + 1 : end;
  }
  stream.partial.erase(0, begin);
  output.write(stream.out_fd, std::move(out));
}

// Reads what `stream` has, up to `reads` times, queueing its whole lines.
// At the end of the pipe (or on an error reading it), queues the last
// partial line and closes it.
bool read_stream(
    Output& output, const Rank& rank, Stream& stream, int reads, bool bounded) {
  char buffer[kReadSize];
  for (int i = 0; i < reads && stream.fd >= 0; ++i) {
    if (bounded && output.over_bound()) {
      return false;
    }
    const ssize_t n = ::read(stream.fd, buffer, sizeof(buffer));
    if (n > 0) {
      print_lines(output, rank, stream, buffer, static_cast<size_t>(n), false);
    } else if (n < 0 && errno == EINTR) {
      --i;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else {
      print_lines(output, rank, stream, nullptr, 0, /*flush=*/true);
      ::close(stream.fd);
      stream.fd = -1;
    }
  }
  return true;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) {
    return "exited with code " + std::to_string(WEXITSTATUS(status));
  }
  const int signo = WTERMSIG(status);
  const std::string number = "signal " + std::to_string(signo);
  const std::string name = signal_name(signo);
  std::string text = "was killed by " + name;
  if (name != number) {
    text += " (" + number + ")";
  }
#ifdef WCOREDUMP
  if (WCOREDUMP(status)) {
    text += " (core dumped)";
  }
#endif
  return text;
}

bool failed(int status) {
  return !WIFEXITED(status) || WEXITSTATUS(status) != 0;
}

std::string format_seconds(double seconds) {
  std::ostringstream text;
  text << seconds << " s";
  return text.str();
}

}  // namespace gpipe_run
