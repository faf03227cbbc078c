// gpipe-run's writer thread (see run_output.h).

#include "run_output.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include "run_io.h"

namespace gpipe_run {

// Note [Writing the output]
// A write to gpipe-run's stdout or stderr waits as long as its reader does
// not read: a paused `less`, a terminal stopped with Ctrl-S, a log pipe
// that is stuck. Were the loop to write, it would wait there too, and no
// signal would be acted on: no SIGTERM forwarded, no SIGKILL after --grace,
// no second SIGINT. So the loop only queues what it prints, the ranks'
// lines and its own messages in the order it makes them, and this thread
// writes them, with every signal blocked (the loop's thread gets them all).
//
// The queue is bounded, so that the ranks still wait for a slow reader
// rather than filling gpipe-run's memory: while more than kOutputBound
// bytes wait, the loop polls no rank's pipe, and a rank that writes on
// blocks once its pipe is full, as it would writing to the reader itself.
// Draining a rank that has ended (kDrainReads) also stops at the bound,
// unless no process is left in its group: then nothing can add to its
// pipes, and what they hold is queued, so that the loop can end. The writer
// wakes the loop through a pipe when the queue goes back under the bound,
// and when it becomes empty: at the end gpipe-run waits for that, still
// acting on signals (a signal ends the wait, and so does --grace seconds
// when a signal stopped the ranks), before it exits.
//
// gpipe-run now has two threads when it forks a rank, so the new process
// may make only async-signal-safe calls until it execs (the writer could
// hold malloc's lock at the fork): everything the rank needs is prepared
// before the fork (see RankLaunch in run_spawn.h).

Output::Output() {
  int wakeup[2];
  if (!make_pipe(wakeup)) {
    fail_system("cannot create a pipe");
  }
  set_non_blocking(wakeup[0]);
  set_non_blocking(wakeup[1]);
  wakeup_read_ = wakeup[0];
  wakeup_write_ = wakeup[1];
  sigset_t all;
  sigset_t previous;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &previous);
  writer_ = std::thread([this] { run(); });
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
}

// Waits for what is queued to be written, however long the reader takes:
// the normal end has waited for it already (see Launcher::drain_output).
Output::~Output() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  ready_.notify_one();
  writer_.join();
  ::close(wakeup_read_);
  ::close(wakeup_write_);
}

void Output::write(int fd, std::string text) {
  if (text.empty()) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_ += text.size();
    queue_.emplace_back(fd, std::move(text));
  }
  ready_.notify_one();
}

// One line, written whole like the ranks' lines, so that they do not split
// one.
void Output::report(const std::string& message) {
  write(STDERR_FILENO, "gpipe-run: " + message + "\n");
}

bool Output::over_bound() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_ > kOutputBound;
}

bool Output::empty() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_ == 0;
}

void Output::clear_wakeups() const {
  char buffer[64];
  while (::read(wakeup_read_, buffer, sizeof(buffer)) > 0) {
  }
}

// Note [Output that could not be written]
// A reader that closed gpipe-run's stdout (`gpipe-run ... | head -1`) has
// what it wanted: the rest is dropped without a word (EPIPE). Any other
// failed write to stdout (a full disk, an I/O error) lost what the ranks
// printed, their results maybe, as a program of one process that cannot
// write its output fails: so a job whose ranks all succeeded exits 1, saying
// so on stderr. Failed writes to stderr, the ranks' diagnostics, change
// nothing.
std::string Output::stdout_lost() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stdout_error_ == 0 ? std::string() : errno_text(stdout_error_);
}

// Exits only once the queue is empty, so that nothing queued is lost.
void Output::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      return;  // stop_, with nothing left
    }
    auto [fd, text] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    const int error = write_all(fd, text.data(), text.size());
    lock.lock();
    if (fd == STDOUT_FILENO && error != 0 && error != EPIPE &&
        stdout_error_ == 0) {
      stdout_error_ = error;
    }
    const bool was_over = bytes_ > kOutputBound;
    bytes_ -= text.size();
    if ((was_over && bytes_ <= kOutputBound) || bytes_ == 0) {
      // Non-blocking: a full pipe already wakes the loop.
      const char byte = 0;
      [[maybe_unused]] const auto ignored = ::write(wakeup_write_, &byte, 1);
    }
  }
}

}  // namespace gpipe_run
