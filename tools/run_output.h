#pragma once

// gpipe-run's output: every line it prints (the ranks' and its own) goes
// through one bounded queue to a writer thread, so that a reader that stops
// reading never stops the loop that handles signals. See Note [Writing the
// output] in run_output.cpp.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace gpipe_run {

// How many bytes may wait in the queue before the loop stops reading the
// ranks' pipes. More than a piece of a long line (kMaxLine) with its
// prefixes, so that one read's lines always fit.
constexpr size_t kOutputBound = 4 << 20;

class Output {
 public:
  /// Starts the writer thread, with every signal blocked in it.
  Output();
  /// Waits for the writer to write what is queued, then joins it.
  ~Output();
  Output(const Output&) = delete;
  Output& operator=(const Output&) = delete;

  /// Queues `text` for `fd` (STDOUT_FILENO or STDERR_FILENO). Never waits.
  void write(int fd, std::string text);
  /// Queues "gpipe-run: <message>\n" for stderr, after what is queued.
  void report(const std::string& message);
  /// Whether more than kOutputBound bytes wait: the loop reads no rank's
  /// pipe until there is room again.
  bool over_bound() const;
  /// Whether nothing waits and nothing is being written.
  bool empty() const;
  /// The read end of a non-blocking pipe that becomes readable when the
  /// queue goes back under its bound or becomes empty; drain it with
  /// clear_wakeups().
  int wakeup_fd() const {
    return wakeup_read_;
  }
  void clear_wakeups() const;
  /// The first error, but a closed reader's, that lost some of the ranks'
  /// standard output (errno_text of it), or "" (Note [Output that could not
  /// be written] in run_output.cpp).
  std::string stdout_lost() const;

 private:
  void run();

  // Guards every member below it; the writer thread waits on `ready_`.
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::pair<int, std::string>> queue_;
  // The bytes in `queue_` plus those being written.
  size_t bytes_ = 0;
  bool stop_ = false;
  int stdout_error_ = 0;  // the first errno but EPIPE of a stdout write
  // Written once, before the thread starts.
  int wakeup_read_ = -1;
  int wakeup_write_ = -1;
  std::thread writer_;
};

}  // namespace gpipe_run
