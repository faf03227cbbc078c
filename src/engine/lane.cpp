#include "engine/lane.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <system_error>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace gpipe::detail {

// Note [Lanes and glibc's malloc]
// glibc gives each thread that allocates an arena of its own. An arena other
// than the main one lives in heaps of at most 64 MiB, and by default it unmaps
// a heap as soon as the heap is free and shrinks the last one, and big blocks
// come from mmap and go back at free. A lane's activations (megabytes each, a
// whole partition's worth in flight) therefore went back to the system at the
// end of every step and came back as fresh pages in the next: a conv model
// through 2 lanes at chunks 1 took 27,000 minor page faults and 2 to 3 times
// the plain model's time per step (gpipe-bench --only conv). Three settings
// make every arena keep what it frees: no mmap for big blocks, no trimming,
// and a top pad of a whole heap, which is what stops glibc from unmapping a
// free heap or shrinking the last one (the trim threshold alone does not). The
// arenas stay one per thread (up to glibc's limit of 8 per core, after which
// threads share them): a single arena for the whole process (how this began)
// kept the pages too, but its one lock made every malloc of two lanes wait for
// the other's, which slowed pipelines of small cells most
// (docs/benchmark-history.md, "Lanes that wait on nothing"). A block over 64
// MiB still comes from mmap on a lane (no heap holds it). These are settings
// of the whole process, read at each free, so they hold for threads started
// before them too, and for memory freed from then on. The cost: what a thread
// frees stays in its arena until the process ends, so the process holds each
// thread's peak (the lanes', and the calling thread's for a serial plan: Note
// [A serial plan on the calling thread]), not one peak for all; and with the
// pad, the top of a thread's heap creeps up over a long run, so that a lane
// whose peak is small keeps up to the pad's 64 MiB resident (a 16 MiB pad
// keeps about 14 MiB, none keeps none: docs/guide.md, section 2).
// gpipe::dist::init_from_env and the profiler's copies (balance_by_time) call
// it too.
// The user's own settings win: with GPIPE_MALLOC=system, MALLOC_ARENA_MAX,
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or
// GLIBC_TUNABLES in the environment, malloc is left alone (as it is under
// another allocator, such as jemalloc).
void keep_freed_memory_once() {
  // Checked at every call, so that a value set after the first is not
  // taken in silence either.
  const char* choice = std::getenv("GPIPE_MALLOC");
  TORCH_CHECK_VALUE(
      choice == nullptr || *choice == '\0' || std::string(choice) == "system",
      "gpipe expects GPIPE_MALLOC to be unset (gpipe's malloc settings) or "
      "'system' (glibc's own), but got '",
      choice,
      "'");
#if defined(__GLIBC__) && defined(M_TOP_PAD)
  static const bool done = [choice] {
    if (choice != nullptr && std::string(choice) == "system") {
      return false;
    }
    for (const char* name :
         {"MALLOC_ARENA_MAX",
          "MALLOC_MMAP_THRESHOLD_",
          "MALLOC_TRIM_THRESHOLD_",
          "MALLOC_MMAP_MAX_",
          "MALLOC_TOP_PAD_",
          "GLIBC_TUNABLES"}) {
      if (std::getenv(name) != nullptr) {
        return false;
      }
    }
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
    // A whole heap (HEAP_MAX_SIZE on 64-bit glibc).
    mallopt(M_TOP_PAD, 64 << 20);
    return true;
  }();
  (void)done;
#endif
}

// Note [Lanes across fork()]
// fork() copies the process but only the thread that called it: a child
// holds the parent's Lane objects, whose threads do not run there. Posting
// to one would wait forever for a cell that never runs, and destroying one
// (a child leaving main with a GPipe alive) hung in the condition
// variable's destructor, which waits for the parent's thread to leave it,
// or would in join(). So a pipeline refuses passes in a child
// (Pipeline::begin_pass), and a lane destroyed there lets its state go
// unfreed: the memory is the child's copy of the parent's, and goes with
// the process. A GPipe built in the child has lanes of its own and works.

namespace {

std::thread start_thread(std::function<void()> body) {
  try {
    return std::thread(std::move(body));
  } catch (const std::system_error& e) {
    TORCH_CHECK(
        false,
        "gpipe could not start a lane's thread (each lane of a GPipe runs "
        "on a thread of its own, and the calling thread is one more): ",
        e.what(),
        "; a limit on threads or processes (ulimit -u, a container's pids "
        "limit) may have been reached");
  }
}

}  // namespace

int64_t current_process() {
  return static_cast<int64_t>(::getpid());
}

Lane::Lane(std::function<void()> init)
    : state_(std::make_unique<State>()), process_(current_process()) {
  // Note [Lanes and glibc's malloc].
  keep_freed_memory_once();
  auto* state = state_.get();
  state->thread = start_thread([state, init = std::move(init)]() mutable {
    loop(*state, std::move(init));
  });
}

Lane::~Lane() {
  if (forked()) {
    (void)state_.release();  // Note [Lanes across fork()]
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->cv.notify_one();
  state_->thread.join();
}

bool Lane::forked() const {
  return current_process() != process_;
}

void Lane::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->queue.push_back(std::move(task));
  }
  state_->cv.notify_one();
}

void Lane::loop(State& state, std::function<void()> init) {
  if (init) {
    init();
  }
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(state.mutex);
      state.cv.wait(
          lock, [&state] { return state.stop || !state.queue.empty(); });
      // Leave only once the queue is empty: a waiting caller counts on every
      // posted task running.
      if (state.queue.empty()) {
        return;
      }
      task = std::move(state.queue.front());
      state.queue.pop_front();
    }
    task();
  }
}

bool FirstError::set(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) {
    return false;
  }
  error_ = std::move(error);
  return true;
}

bool FirstError::has() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(error_);
}

void FirstError::rethrow_and_clear() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, error_);
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

std::exception_ptr with_context(
    std::exception_ptr error, const std::string& where) {
  try {
    std::rethrow_exception(error);
  } catch (c10::Error& e) {
    // c10::Error puts a lone context in parentheses itself.
    e.add_context("in gpipe " + where);
    return std::current_exception();
  } catch (const std::exception& e) {
    try {
      TORCH_CHECK(false, e.what(), " (in gpipe ", where, ")");
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    try {
      TORCH_CHECK(false, "unknown exception (in gpipe ", where, ")");
    } catch (...) {
      return std::current_exception();
    }
  }
  return error;
}

}  // namespace gpipe::detail
