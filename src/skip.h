#pragma once

// The engine's side of skip connections: where `stash`/`pop` go on the
// running thread, which layer is inside its forward, and the routes of skips
// between partitions. The user's side is include/gpipe/skip.h.

#include <gpipe/skip.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

/// Where the stashes and pops of the running thread go.
class SkipTracker {
 public:
  virtual ~SkipTracker() = default;
  virtual void stash(const SkipKey& key, torch::Tensor tensor) = 0;
  virtual torch::Tensor pop(const SkipKey& key) = 0;
};

/// Outside GPipe: a table per thread. A pop takes the tensor out of it.
class PlainSkipTracker final : public SkipTracker {
 public:
  void stash(const SkipKey& key, torch::Tensor tensor) override;
  torch::Tensor pop(const SkipKey& key) override;
  size_t size() const {
    return tensors_.size();
  }
  void clear() {
    tensors_.clear();
  }

 private:
  std::map<SkipKey, torch::Tensor> tensors_;
};

/// The tracker of the running thread: the one a guard installed, else the
/// thread's own PlainSkipTracker.
SkipTracker& current_skip_tracker();
/// This thread's own PlainSkipTracker.
PlainSkipTracker& plain_skip_tracker();

/// Installs `tracker` on this thread for its lifetime.
class SkipTrackerGuard {
 public:
  explicit SkipTrackerGuard(SkipTracker* tracker);
  ~SkipTrackerGuard();
  SkipTrackerGuard(const SkipTrackerGuard&) = delete;
  SkipTrackerGuard& operator=(const SkipTrackerGuard&) = delete;

 private:
  SkipTracker* previous_;
};

/// One cell's tracker inside the pipeline. Skips stashed and popped in the
/// same partition stay in the cell (their gradient flows through the cell's
/// own graph); skips routed out are collected in `outgoing`, and pops of
/// skips routed in are served from `incoming`.
class CellSkipTracker final : public SkipTracker {
 public:
  CellSkipTracker(
      const std::set<SkipKey>& routed_out,
      std::map<SkipKey, torch::Tensor> incoming)
      : routed_out_(routed_out), incoming_(std::move(incoming)) {}

  void stash(const SkipKey& key, torch::Tensor tensor) override;
  torch::Tensor pop(const SkipKey& key) override;

  /// Stashed skips bound for later partitions.
  std::map<SkipKey, torch::Tensor>& outgoing() {
    return outgoing_;
  }

 private:
  const std::set<SkipKey>& routed_out_;
  std::map<SkipKey, torch::Tensor> incoming_;
  std::map<SkipKey, torch::Tensor> local_;
  std::map<SkipKey, torch::Tensor> outgoing_;
};

/// Marks `layer` as being inside its forward on this thread, so that its
/// stashes and pops are counted; `check()` throws if a declared name was not
/// used.
struct SkipUsage {
  const Skippable* layer = nullptr;
  std::vector<std::string> stashed;
  std::vector<std::string> popped;
};

class SkipUsageGuard {
 public:
  explicit SkipUsageGuard(const Skippable* layer);
  ~SkipUsageGuard();
  SkipUsageGuard(const SkipUsageGuard&) = delete;
  SkipUsageGuard& operator=(const SkipUsageGuard&) = delete;
  /// Throws `c10::Error` naming the declared names that were not used.
  void check() const;

 private:
  SkipUsage usage_;
  SkipUsage* previous_;
};

/// Called by Skippable::stash/pop: counts the use when `layer` is the one
/// inside a SkipUsageGuard.
void note_skip_use(const Skippable* layer, const std::string& name, bool stash);

/// The routes of skips between partitions: each key's stashing and popping
/// partition.
class SkipLayout {
 public:
  SkipLayout() = default;
  /// Routes of the layers of `partitions` (declarations must already have
  /// passed verify_skippables).
  explicit SkipLayout(const std::vector<torch::nn::Sequential>& partitions);

  /// (stashing partition, key) of every skip popped in partition `j` but
  /// stashed in an earlier one, by stashing partition then key.
  const std::vector<std::pair<int64_t, SkipKey>>& copy_policy(int64_t j) const;
  /// Keys stashed in partition `j` and popped in a later one.
  const std::set<SkipKey>& routed_out(int64_t j) const;
  /// True when `key` crosses partitions.
  bool requires_copy(const SkipKey& key) const;
  /// (stashing partition, popping partition) of `key`.
  std::pair<int64_t, int64_t> route(const SkipKey& key) const;
  /// True if any skip crosses partitions.
  bool any_copy() const;

 private:
  std::map<SkipKey, std::pair<int64_t, int64_t>> routes_;
  std::vector<std::vector<std::pair<int64_t, SkipKey>>> copy_policy_;
  std::vector<std::set<SkipKey>> routed_out_;
};

}  // namespace gpipe::detail
