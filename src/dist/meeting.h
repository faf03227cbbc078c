#pragma once

// Joining a job (init_from_env): every rank meets the others at rank 0's
// store, under one deadline. See Note [Meeting within the timeout] in
// dist/meeting.cpp.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace gpipe::dist::detail {

/// Counts rank `rank` of `size` in at `store` (`where` names it in
/// messages: "host:port") and returns once every rank has come; throws a
/// c10::Error without backtrace when the store does not answer, when the
/// ranks disagree on WORLD_SIZE or a RANK came twice (every waiting rank
/// then fails at once, saying why), or at `deadline`. The rank that
/// `hosts_store` stays until the others have read why the job cannot start.
void meet(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    std::string where,
    std::chrono::steady_clock::time_point deadline,
    std::chrono::milliseconds timeout,
    bool hosts_store);

/// Called by a rank 0 that cannot listen on its port, with a client of the
/// store there: tells the rank 0 that holds it, when it waits for a job of
/// `size` ranks, that a second rank 0 came (Note [A second rank 0] in
/// dist/meeting.cpp). True when it did.
bool tell_a_first_rank_0(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t size);

/// Holds back LibTorch's own log lines below FATAL while it lives (see Note
/// [c10d's lines on a failed connect] in dist/meeting.cpp). One at a time.
class QuietLibTorchLog {
 public:
  QuietLibTorchLog();
  ~QuietLibTorchLog();
  QuietLibTorchLog(const QuietLibTorchLog&) = delete;
  QuietLibTorchLog& operator=(const QuietLibTorchLog&) = delete;

 private:
  int* glog_level_ = nullptr;
  int saved_glog_level_ = 0;
  int saved_c10_level_ = 0;
};

}  // namespace gpipe::dist::detail
