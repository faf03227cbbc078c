#pragma once

// Autocast in cells (engine-internal): a pass's cells run under the autocast
// settings of the thread that began it, wherever they run, and never with
// autocast's cache of cast weights. Note [Autocast in cells] in
// engine/autocast.cpp.

#include <c10/core/ScalarType.h>

namespace gpipe::detail {

/// Whether autocast is on for the CPU and for CUDA, and to which dtypes.
struct AutocastState {
  bool cpu = false;
  bool cuda = false;
  c10::ScalarType cpu_dtype = c10::kBFloat16;
  c10::ScalarType cuda_dtype = c10::kHalf;

  /// This thread's.
  static AutocastState current();
  bool any() const {
    return cpu || cuda;
  }
};

/// While alive: this thread runs under `state`, with autocast's cast cache
/// off; then as it was. Nothing where autocast is off both in `state` and
/// on this thread.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  static void apply(const AutocastState& state);

  bool active_ = false;
  AutocastState found_;
  bool cache_found_ = true;
};

}  // namespace gpipe::detail
