#include "engine/lane.h"

#include <c10/util/Exception.h>

namespace gpipe::detail {

Lane::Lane(std::function<void()> init)
    : thread_([this, init = std::move(init)]() mutable {
        loop(std::move(init));
      }) {}

Lane::~Lane() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Lane::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void Lane::loop(std::function<void()> init) {
  if (init) {
    init();
  }
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      // Leave only once the queue is empty: a waiting caller counts on every
      // posted task running.
      if (queue_.empty()) {
        return;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
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
    e.add_context("(in gpipe " + where + ")");
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
