#pragma once

// Random numbers for cells that run at the same time on different lanes.
//
// Note [Random streams of concurrent cells]
// LibTorch has one default CPU generator per process (one CUDA generator per
// device). Lanes that draw from it concurrently would interleave in an order
// that changes from run to run, so neither the dropout masks of a run nor the
// replay of a checkpointed cell could be reproduced, and saving/restoring the
// generator state (torchgpipe's way, safe there only because its CPU
// partitions share one thread) would disturb the other lanes.
//
// Instead every cell gets its own seed, derived from a step seed drawn once
// per forward on the caller's thread and the cell's (micro-batch, partition).
// A partition that draws random numbers runs while holding a process-wide
// lease, with the default generators of the CPU and of its device seeded with
// the cell seed; the recomputation reseeds with the same seed and so replays
// the same masks. Whether a partition draws at all is found out on its first
// run in each mode (training / eval) by comparing the generator states before
// and after; partitions that never draw run without the lease, in parallel.
// The caller saves the generator states before a pipeline pass and restores
// them afterwards, so the user's random stream only advances by the step
// seed.

#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

namespace gpipe::detail {

/// What is known about one partition's use of the random generators.
class RandomUse {
 public:
  /// Runs `fn` so that its random draws depend on `seed` alone.
  void run_seeded(
      torch::Device device,
      bool training,
      uint64_t seed,
      const std::function<void()>& fn);

  /// False once a run in this mode drew nothing.
  bool may_draw(bool training) const {
    return state_[training ? 1 : 0].load() != kNever;
  }

 private:
  static constexpr int kUnknown = 0;
  static constexpr int kDraws = 1;
  static constexpr int kNever = 2;
  // Written by the partition's lane, read by the caller between passes.
  std::atomic<int> state_[2] = {{kUnknown}, {kUnknown}};
};

/// A seed for one step of the pipeline, drawn from the default CPU generator.
uint64_t draw_step_seed();

/// Mixes a step seed with a cell's coordinates.
uint64_t cell_seed(uint64_t step_seed, int64_t micro_batch, int64_t partition);

/// Saves the default generators of the CPU and of `devices` on construction
/// and restores them on destruction (see Note [Random streams of concurrent
/// cells]).
class GeneratorStateGuard {
 public:
  explicit GeneratorStateGuard(const std::vector<torch::Device>& devices);
  ~GeneratorStateGuard();
  GeneratorStateGuard(const GeneratorStateGuard&) = delete;
  GeneratorStateGuard& operator=(const GeneratorStateGuard&) = delete;

 private:
  std::vector<torch::Device> devices_;
  std::vector<torch::Tensor> states_;
};

}  // namespace gpipe::detail
