#pragma once

// The transport between lanes of one process: one slot per (direction,
// micro-batch, boundary), handed over under a mutex.

#include <condition_variable>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/transport.h"

namespace gpipe::detail {

class InProcessTransport final : public Transport {
 public:
  InProcessTransport(int64_t micro_batches, int64_t stages);

  void send(Phase phase, int64_t i, int64_t k, Packet packet) override;
  Packet recv(Phase phase, int64_t i, int64_t k) override;
  void send_skip(
      Phase phase, int64_t i, const SkipKey& key, torch::Tensor t) override;
  torch::Tensor recv_skip(Phase phase, int64_t i, const SkipKey& key) override;
  void abort() override;
  bool aborted() const override;

 private:
  const int64_t m_;
  const int64_t n_;
  mutable std::mutex mutex_;
  // Indexed by direction (Phase), then micro-batch, then boundary.
  std::vector<std::vector<Packet>> slots_[2];  // guarded by mutex_
  std::vector<std::vector<char>> ready_[2];    // guarded by mutex_
  // Each boundary of one direction has one receiver (one lane, or the
  // caller after the pass): per boundary, the micro-batch it waits for, or
  // -1, so that a send wakes only a receiver that waits for it. Waking
  // threads that go back to sleep costs more than a small cell's work.
  std::vector<int64_t> waiting_[2];  // guarded by mutex_
  std::vector<std::condition_variable> boundary_cvs_[2];
  std::map<std::pair<int64_t, SkipKey>, torch::Tensor> skips_[2];  // mutex_
  std::condition_variable skip_cv_;
  bool aborted_ = false;  // guarded by mutex_
};

}  // namespace gpipe::detail
