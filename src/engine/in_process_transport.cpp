#include "engine/in_process_transport.h"

namespace gpipe::detail {

InProcessTransport::InProcessTransport(int64_t m, int64_t n)
    : m_(m),
      n_(n),
      boundary_cvs_{
          std::vector<std::condition_variable>(n + 1),
          std::vector<std::condition_variable>(n + 1)} {
  for (const auto d : {0, 1}) {
    slots_[d].assign(m_, std::vector<Packet>(n_ + 1));
    ready_[d].assign(m_, std::vector<char>(n_ + 1, 0));
    waiting_[d].assign(n_ + 1, -1);
  }
}

void InProcessTransport::send(Phase phase, int64_t i, int64_t k, Packet p) {
  const auto d = static_cast<size_t>(phase);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slots_[d][i][k] = std::move(p);
    ready_[d][i][k] = 1;
    wake = waiting_[d][k] == i;
  }
  if (wake) {
    boundary_cvs_[d][k].notify_one();
  }
}

Packet InProcessTransport::recv(Phase phase, int64_t i, int64_t k) {
  const auto d = static_cast<size_t>(phase);
  std::unique_lock<std::mutex> lock(mutex_);
  auto& ready = ready_[d];
  if (!ready[i][k] && !aborted_) {
    waiting_[d][k] = i;
    boundary_cvs_[d][k].wait(lock, [&] { return ready[i][k] || aborted_; });
    waiting_[d][k] = -1;
  }
  if (!ready[i][k]) {
    throw Aborted{};
  }
  ready[i][k] = 0;
  return std::move(slots_[d][i][k]);
}

void InProcessTransport::send_skip(
    Phase phase, int64_t i, const SkipKey& key, torch::Tensor t) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    skips_[static_cast<size_t>(phase)].insert_or_assign({i, key}, std::move(t));
  }
  skip_cv_.notify_all();
}

torch::Tensor InProcessTransport::recv_skip(
    Phase phase, int64_t i, const SkipKey& key) {
  auto& skips = skips_[static_cast<size_t>(phase)];
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = skips.find({i, key});
  while (it == skips.end()) {
    if (aborted_) {
      throw Aborted{};
    }
    skip_cv_.wait(lock);
    it = skips.find({i, key});
  }
  auto t = std::move(it->second);
  skips.erase(it);
  return t;
}

void InProcessTransport::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  for (auto& cvs : boundary_cvs_) {
    for (auto& cv : cvs) {
      cv.notify_all();
    }
  }
  skip_cv_.notify_all();
}

bool InProcessTransport::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

}  // namespace gpipe::detail
