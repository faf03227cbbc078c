#pragma once

// gpipe-run's plumbing: the ranks' output cut into whole lines with their
// prefix, gpipe-run's own messages, pipes and descriptors, a free port, and
// how a rank ended. Plain POSIX; the loop's thread uses all of it, and the
// writer thread (run_output.h) write_all.

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace gpipe_run {

class Output;

// Bytes read from a pipe at a time.
constexpr size_t kReadSize = 64 * 1024;
// A line longer than this is printed in pieces of this size, each with the
// prefix, rather than held in memory until its newline comes.
constexpr size_t kMaxLine = 1 << 20;

// One of a rank's two output streams.
struct Stream {
  // The read end of the pipe; -1 once it is closed.
  int fd = -1;
  // Where its lines go: STDOUT_FILENO or STDERR_FILENO.
  int out_fd = -1;
  // What was read after the last newline.
  std::string partial;
};

struct Rank {
  // Its RANK in the job (with --node-rank, not its index on this host):
  // what its prefix and gpipe-run's messages name.
  int64_t rank = 0;
  // Also its process group: each rank leads one of its own, so that SIGTERM
  // reaches whatever it started too.
  pid_t pid = -1;
  bool running = false;
  // waitpid's status, once it has ended (running is false).
  int status = 0;
  // Whether the stop sent it SIGTERM while it ran: one of the ranks that
  // gpipe-run stopped, rather than one that ended on its own.
  bool stopped = false;
  Stream streams[2];
  // "[rank] ", before each of its lines.
  std::string prefix;
};

std::string errno_text(int error);
/// Throws std::runtime_error with `what` and errno's text.
[[noreturn]] void fail_system(const std::string& what);
std::string signal_name(int signo);
/// Writes all of `data` to `fd`; returns 0, or the errno of the write that
/// failed (the rest is dropped).
int write_all(int fd, const char* data, size_t size);
/// gpipe-run's own message, written at once: only while no Output exists
/// (a bad command line, gpipe-run's own failure).
void report(const std::string& message);
/// As report(), but only when stderr can take the line at once (a pipe
/// with room, a file, a terminal not stopped).
void report_if_writable(const std::string& message);
void open_standard_fds();
bool make_pipe(int fds[2]);
void set_non_blocking(int fd);
int find_free_port();
void print_lines(
    Output& output,
    const Rank& rank,
    Stream& stream,
    const char* data,
    size_t size,
    bool flush);
/// Reads what `stream` has, up to `reads` times, queueing its whole lines;
/// at its end, closes it. With `bounded`, false when it stopped because
/// `output` is over its bound, with more perhaps left in the pipe.
bool read_stream(
    Output& output,
    const Rank& rank,
    Stream& stream,
    int reads,
    bool bounded = true);
std::string describe_status(int status);
/// Whether a wait status is a failure: an exit code other than 0, or a
/// signal.
bool failed(int status);
/// `seconds` as "<seconds> s".
std::string format_seconds(double seconds);

}  // namespace gpipe_run
