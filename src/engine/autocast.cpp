#include "engine/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace gpipe::detail {

// Note [Autocast in cells]
// Autocast is a thread's setting, and so is the dtype it casts to: a lane
// took the enabled flags from the caller (at::ThreadLocalState carries
// them) but not the dtypes, and a checkpointed cell's recomputation ran
// under whatever the backward's thread had (a backward outside the autocast
// region recomputed in float32 from a bfloat16 input: "mat1 and mat2 must
// have the same dtype"). So a pass notes the caller's settings when it
// begins, and every forward, loss and recomputation of its cells runs
// under them, as torch.utils.checkpoint recomputes under the forward's.
//
// Autocast also keeps, per thread (in LibTorch 1.13), the lower-precision
// copy of each weight it cast, until at::autocast::clear_cache() on that
// thread: the caller's clear_cache() never reached a lane's, so a lane
// computed every later step with the weights of the first (wrong outputs
// after an optimizer step, without a word). And a checkpointed forward,
// which runs without grad, cached copies without a graph, which the
// recomputation then used: the parameters behind them (the biases) got no
// gradient. So cells run with the cache off: each cell casts the weights
// it uses (once per micro-batch, where the plain model casts once per
// step), and no cell leaves a cast behind for another.

// LibTorch 2.4 made the per-device calls one call with a device type, and
// the old ones warn at every call.
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
AutocastState AutocastState::current() {
  AutocastState state;
  state.cpu = at::autocast::is_autocast_enabled(at::kCPU);
  state.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
  state.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  state.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  return state;
}

void AutocastScope::apply(const AutocastState& state) {
  at::autocast::set_autocast_enabled(at::kCPU, state.cpu);
  at::autocast::set_autocast_enabled(at::kCUDA, state.cuda);
  at::autocast::set_autocast_dtype(at::kCPU, state.cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, state.cuda_dtype);
}
#else
AutocastState AutocastState::current() {
  AutocastState state;
  state.cpu = at::autocast::is_cpu_enabled();
  state.cuda = at::autocast::is_enabled();
  state.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
  state.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
  return state;
}

void AutocastScope::apply(const AutocastState& state) {
  at::autocast::set_cpu_enabled(state.cpu);
  at::autocast::set_enabled(state.cuda);
  at::autocast::set_autocast_cpu_dtype(state.cpu_dtype);
  at::autocast::set_autocast_gpu_dtype(state.cuda_dtype);
}
#endif

AutocastScope::AutocastScope(const AutocastState& state)
    : found_(AutocastState::current()) {
  if (!state.any() && !found_.any()) {
    return;
  }
  active_ = true;
  cache_found_ = at::autocast::is_autocast_cache_enabled();
  apply(state);
  at::autocast::set_autocast_cache_enabled(false);
}

AutocastScope::~AutocastScope() {
  if (active_) {
    apply(found_);
    at::autocast::set_autocast_cache_enabled(cache_found_);
  }
}

}  // namespace gpipe::detail
