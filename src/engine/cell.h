#pragma once

// What each cell of a stage runs under and hands on (engine-internal): the
// scope that puts a thread inside a cell on the stage's device, the leaves a
// cell makes of what it takes and the tensors it sends, the buffers a
// recomputation puts back, and the trace's timestamps.

#include <c10/core/DeviceGuard.h>
#include <torch/types.h>

#include <chrono>
#include <vector>

#include "engine/stage.h"

namespace gpipe {
enum class TraceKind;
}  // namespace gpipe

namespace gpipe::detail {

/// While alive: this thread is inside a cell (inside_cell()), on the
/// stage's device.
class CellScope {
 public:
  explicit CellScope(torch::Device device);
  ~CellScope();
  CellScope(const CellScope&) = delete;
  CellScope& operator=(const CellScope&) = delete;

 private:
  c10::OptionalDeviceGuard device_guard_;
};

inline bool is_differentiable(const torch::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

/// `t` detached and on `device`: a leaf of the graph of the cell that takes
/// it, requiring grad when the tensor it stands for does and a graph is
/// built.
torch::Tensor leaf_of(const torch::Tensor& t, torch::Device device, bool grad);

/// What a cell sends on: `t` detached, requiring grad when `grad` (the
/// receiver makes its leaf require grad from it).
torch::Tensor sendable(const torch::Tensor& t, bool grad);

/// Puts a partition's buffers back to the values they had when saved, on
/// restore() or on destruction (a failing backward).
class BufferRestore {
 public:
  BufferRestore() = default;
  BufferRestore(const BufferRestore&) = delete;
  BufferRestore& operator=(const BufferRestore&) = delete;
  ~BufferRestore();

  void save(std::vector<torch::Tensor> buffers);
  void restore();

 private:
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> saved_;
};

/// While alive: a partition's modules in the modes `forward` recorded, when
/// they are in others now (a model put in eval() between a checkpointed
/// forward and its backward), and its parameters frozen that were then;
/// then back as found, also when the recomputation fails. Nothing when
/// they are as recorded, or `forward` is null. Note [The modes of a
/// recomputation] in engine/cell.cpp.
class ModeRestore {
 public:
  explicit ModeRestore(const ModeSnapshot* forward);
  ~ModeRestore();
  ModeRestore(const ModeRestore&) = delete;
  ModeRestore& operator=(const ModeRestore&) = delete;

 private:
  void put_back();

  const ModeSnapshot* forward_ = nullptr;  // null: no modes to put back
  std::vector<torch::Tensor> unfrozen_;    // frozen again for a while
  std::vector<bool> found_;      // the modes found (in_training() for a
                                 // DeferredBatchNorm)
  std::vector<bool> own_found_;  // each module's own flag found
};

/// On this thread: the cell that threw last threw in its recomputation
/// (set by Stage::backward as the error leaves it; read and cleared by the
/// runner, which names the recomputation in the error and the trace).
bool& failed_in_recomputation();

using CellClock = std::chrono::steady_clock;

/// Now, when tracing; a stage pays only this test otherwise.
inline CellClock::time_point stamp(const CellContext& ctx) {
  return ctx.trace ? CellClock::now() : CellClock::time_point();
}

/// Records [start, end) as the `kind` of stage `stage`'s cell, when
/// tracing.
void record(
    const CellContext& ctx,
    int64_t stage,
    TraceKind kind,
    CellClock::time_point start,
    CellClock::time_point end);

}  // namespace gpipe::detail
