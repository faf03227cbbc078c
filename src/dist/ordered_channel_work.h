#pragma once

// The c10d works of the ordered channel (src/dist/ordered_channel.cpp, Note
// [Tags over an ordered backend]): a message's send, posted by a writer
// thread, and a receive posted on a tag, ended by a reader thread.

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace gpipe::dist::detail::ordered {

// Waits until `work` has finished on the GPU, or `stop()` says to give up
// (false then).
template <class Stop>
bool finished(const c10::intrusive_ptr<c10d::Work>& work, Stop&& stop) {
  int spins = 0;
  while (!work->isCompleted()) {
    if (stop()) {
      return false;
    }
    if (++spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

// A message to a peer: posted by the peer's writer, and ended when the
// peer's GPU holds its bytes.
class SendWork final : public c10d::Work {
 public:
  // `poll`: the backend's works say when they end (NCCL's); else they end
  // only when waited for (Gloo's), and are waited for.
  explicit SendWork(bool poll) : poll_(poll) {}

  // Called once, by the writer or by an abort.
  // `head`: the frame's send before `last` (kept while the message is in
  // flight: a Gloo send ends when its work goes). `kept`: the writer's
  // tensors (the frame, the message's bytes), released after the backend's
  // works, so that their last release is this work's, on the thread that
  // drops it (a backend's work may be released inside LibTorch, where
  // ThreadSanitizer sees no ordering with the writer's own releases).
  void posted(
      c10::intrusive_ptr<c10d::Work> last,
      std::string error = {},
      c10::intrusive_ptr<c10d::Work> head = {},
      std::vector<torch::Tensor> kept = {}) {
    {
      std::lock_guard<std::mutex> lock(post_mutex_);
      kept_ = std::move(kept);
      head_ = std::move(head);
      last_ = std::move(last);
      error_ = std::move(error);
      posted_ = true;
    }
    post_cv_.notify_all();
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(post_mutex_);
    return posted_ && (!last_ || (poll_ && last_->isCompleted()));
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto late = [&] {
      return timeout.count() > 0 && std::chrono::steady_clock::now() > deadline;
    };
    c10::intrusive_ptr<c10d::Work> last;
    c10::intrusive_ptr<c10d::Work> head;
    {
      std::unique_lock<std::mutex> lock(post_mutex_);
      if (timeout.count() > 0) {
        post_cv_.wait_until(lock, deadline, [&] { return posted_; });
      } else {
        post_cv_.wait(lock, [&] { return posted_; });
      }
      TORCH_CHECK(posted_, "Operation timed out!");
      TORCH_CHECK(last_, error_);
      last = last_;
      head = head_;
    }
    if (!poll_) {
      if (head) {
        head->wait(timeout);
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      return last->wait(
          timeout.count() > 0 ? std::max(left, std::chrono::milliseconds(1))
                              : timeout);
    }
    TORCH_CHECK(finished(last, late), "Operation timed out!");
    return last->wait();  // rethrows NCCL's error, if any
  }
  // Over a backend whose works end only when waited for (Gloo's), ends a
  // wait on the message's sends: wait() then returns false. (NCCL's works
  // end when the channel aborts their pair's group.)
  void abort() override {
    if (poll_) {
      return;
    }
    c10::intrusive_ptr<c10d::Work> head;
    c10::intrusive_ptr<c10d::Work> last;
    {
      std::lock_guard<std::mutex> lock(post_mutex_);
      head = head_;
      last = last_;
    }
    if (head) {
      head->abort();
    }
    if (last) {
      last->abort();
    }
  }

 private:
  const bool poll_;
  std::mutex post_mutex_;
  std::condition_variable post_cv_;
  bool posted_ = false;
  std::vector<torch::Tensor> kept_;      // declared first: released last
  c10::intrusive_ptr<c10d::Work> last_;  // null when it failed: error_
  c10::intrusive_ptr<c10d::Work> head_;
  std::string error_;
};

// A receive posted on a tag: ends when its message is in `bytes`.
class RecvWork final : public c10d::Work {
 public:
  RecvWork(torch::Tensor bytes, int64_t peer, int tag)
      : bytes_(std::move(bytes)), peer_(peer), tag_(tag) {}

  // The first of deliver, fail and abort ends the receive; the others do
  // nothing.
  void deliver(const torch::Tensor& message) {
    if (done_.exchange(true)) {
      return;
    }
    if (message.numel() != bytes_.numel()) {
      finish(std::make_exception_ptr(std::runtime_error(
          "rank " + std::to_string(peer_) + " sent " +
          std::to_string(message.numel()) + " bytes on tag " +
          std::to_string(tag_) + " where " + std::to_string(bytes_.numel()) +
          " were expected")));
      return;
    }
    // (A plain copy: the posted buffer may be an inference tensor, made
    // under c10::InferenceMode on the thread that posted it.)
    std::memcpy(
        bytes_.data_ptr(),
        message.data_ptr(),
        static_cast<size_t>(message.numel()));
    finish();
  }
  void fail(const std::string& why) {
    if (!done_.exchange(true)) {
      finish(std::make_exception_ptr(std::runtime_error(why)));
    }
  }
  void abort() override {
    fail("the receive was aborted");
  }

 private:
  torch::Tensor bytes_;
  const int64_t peer_;
  const int tag_;
  std::atomic<bool> done_{false};
};

}  // namespace gpipe::dist::detail::ordered
