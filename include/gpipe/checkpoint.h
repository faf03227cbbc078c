#pragma once

// Checkpointing: a checkpointed cell runs its partition under no-grad in the
// forward pass, keeps only its input (and the seed of its random stream), and
// runs the partition again with grad in the backward pass. Layers can ask
// which of the two runs they are in, e.g. to avoid counting a side effect
// twice.

namespace gpipe {

/// True inside the no-grad forward of a checkpointed cell (on that thread).
bool is_checkpointing();

/// True inside the recomputation of a checkpointed cell in backward.
bool is_recomputing();

namespace detail {

/// Sets `is_checkpointing()` for the current thread while alive.
class CheckpointingGuard {
 public:
  CheckpointingGuard();
  ~CheckpointingGuard();
  CheckpointingGuard(const CheckpointingGuard&) = delete;
  CheckpointingGuard& operator=(const CheckpointingGuard&) = delete;

 private:
  bool previous_;
};

/// Sets `is_recomputing()` for the current thread while alive.
class RecomputingGuard {
 public:
  RecomputingGuard();
  ~RecomputingGuard();
  RecomputingGuard(const RecomputingGuard&) = delete;
  RecomputingGuard& operator=(const RecomputingGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace detail
}  // namespace gpipe
