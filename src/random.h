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
// So every cell gets its own seed, derived from a step seed (drawn once per
// pass from the user's generator) and the cell's (micro-batch, stage). On a
// CPU lane a cell that draws gets a generator of its own, seeded with it:
// the random operators it calls without a generator (dropout's bernoulli_,
// rand, randn, ...) take it in place of the default one (cell_generator.h),
// so cells that draw run at once, holding the lease *shared*. A cell that
// draws from the default generator by name (seen as the default generator
// moving meanwhile), and a cell on another device (whose generator is the
// device's default), runs with the default generators seeded with its
// seed, holding a process-wide lease *exclusively*. Either way its
// recomputation reseeds with the same seed and so replays the same
// numbers; the two ways draw the same numbers (a CPU generator seeded with
// a seed starts where the default one reseeded with it does).
//
// Whether a cell draws cannot be known before it runs, and cannot be decided
// once per stage for ever: a dropout probability scheduled up from 0, or a
// DropPath switched on later, makes a stage that never drew start drawing.
// Serialising every cell would cost the lanes their parallelism, so a cell
// that is expected not to draw runs optimistically, holding the lease
// *shared* (with other such cells, never with a seeded one), and checks that
// the generators are where they were when it started. If they moved, some
// cell of the shared group drew from an unseeded generator: every cell that
// saw the move runs again, exclusively and seeded, marked
// `is_recomputing()` and with its buffers put back afterwards, so side
// effects (running statistics, counters) happen once; its outputs replace
// the first run's. This is correct for any layer, whatever its randomness
// does from one step to the next, and costs a shared-lock and two generator
// snapshots per cell (measured by gpipe-bench's `random` section); a re-run
// happens only on the step where a stage starts drawing.
//
// What a stage is expected to do is learnt per mode (training / eval): a
// cell that drew makes the next cells of its stage run seeded; after
// `kPatience` seeded cells in a row that drew nothing, the stage goes back
// to the shared lease.
//
// Recomputation replays exactly what the forward did: seeded when the
// forward drew, on a generator of its own where the forward had one (CPU
// lanes), else exclusively on the default generators, and then checks that
// the generator ends where the forward's ended (so another thread drawing
// from the default generator in the middle of an exclusive replay is an
// error, not a silently wrong gradient); shared otherwise (and then it is
// an error if it draws). Where the default generators moved during a run
// on a generator of its own, it runs again to tell its draws from another
// thread's (Note [A recomputation that saw the generators move] in
// random.cpp).
//
// The user's random stream advances by the step seeds, and gpipe never
// puts it back: what other threads draw from it while a pipeline runs stays
// drawn (an eval pass, or two pipelines on two threads, must not hand out
// the same numbers twice). A cell that runs with the default generators
// seeded saves their states first and puts them back when it ends, under
// the exclusive lease, so seeding costs the user's stream nothing. What a
// cell draws from a default generator unseeded (the optimistic run above
// when its stage starts drawing, or a layer drawing by name) comes from the
// user's stream, as the plain model's draws do; the cell then runs again,
// seeded. A cell never starts a pipeline (that is refused), so the lease is
// never held across one.

#include <ATen/core/MT19937RNGEngine.h>
#include <c10/util/Optional.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace gpipe::detail {

/// The process-wide lease on the default generators: shared or exclusive,
/// writer-preferring (a seeded cell waits only for the shared cells already
/// running).
class RandomLease {
 public:
  static RandomLease& get();
  void lock_shared();
  void unlock_shared();
  void lock();
  void unlock();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t readers_ = 0;          // guarded by mutex_
  int64_t writers_waiting_ = 0;  // guarded by mutex_
  bool writer_ = false;          // guarded by mutex_
};

/// The states of the default generators of the CPU and of `device`. The
/// CPU generator's is read without making a tensor, into the snapshot
/// itself, not a heap block: it is taken twice per cell, and glibc serves
/// a block of this size from its sorted bins, not its per-thread cache.
class GeneratorSnapshot {
 public:
  explicit GeneratorSnapshot(torch::Device device);
  /// The state of `cpu`, a CPU generator (a cell's own).
  explicit GeneratorSnapshot(const at::Generator& cpu);
  ~GeneratorSnapshot();
  bool operator==(const GeneratorSnapshot& other) const;
  bool operator!=(const GeneratorSnapshot& other) const {
    return !(*this == other);
  }
  /// Puts the default generators of the CPU (without a state tensor) and
  /// of the device it was taken on back where they were.
  void restore() const;

 private:
  // The engine's plain data: an at::mt19937 member would seed itself on
  // construction (a 624-word loop, a microsecond).
  struct Cpu {
    at::mt19937_data_pod engine;
    c10::optional<float> next_float;
    c10::optional<double> next_double;
  };
  Cpu cpu_;               // each constructor fills it
  torch::Tensor device_;  // state of the other device's generator, if any
  c10::optional<torch::Device> other_;  // that device
};

/// What a cell's forward did with random numbers, for its recomputation.
struct RandomOutcome {
  bool drew = false;
  /// It drew from a generator of its own (a CPU cell; cell_generator.h),
  /// not from the default generators.
  bool own = false;
  /// Where the generators ended, when it drew.
  std::shared_ptr<GeneratorSnapshot> end;
};

/// What is known of one stage's draws, per mode. Touched by the stage's lane
/// only.
class RandomUse {
 public:
  static constexpr int kPatience = 8;
  /// True when the next cell in this mode should run seeded.
  bool expect_draws(bool training) const {
    return credits_[training ? 1 : 0].load(std::memory_order_relaxed) > 0;
  }
  /// Records whether a cell drew.
  void observe(bool training, bool drew, bool seeded);
  /// True after a cell in this mode saw the default generators move while
  /// it drew from a generator of its own (a layer that draws from them by
  /// name; or another thread, or another stage's first unseeded draw): its
  /// next `kByNamePatience` cells draw in turn from the seeded default
  /// generators without trying their own first, then it tries again.
  static constexpr int kByNamePatience = 64;
  bool draws_by_name(bool training) const {
    return by_name_[training ? 1 : 0].load(std::memory_order_relaxed) > 0;
  }
  void observe_by_name(bool training) {
    by_name_[training ? 1 : 0].store(
        kByNamePatience, std::memory_order_relaxed);
  }
  /// A cell ran in turn because of `draws_by_name`.
  void ran_in_turn(bool training) {
    auto& left = by_name_[training ? 1 : 0];
    left.store(
        std::max(0, left.load(std::memory_order_relaxed) - 1),
        std::memory_order_relaxed);
  }

 private:
  // Seeded cells to run before trusting the shared lease again; 1 at
  // first, so that the first cell in each mode finds out.
  std::atomic<int> credits_[2] = {{1}, {1}};
  std::atomic<int> by_name_[2] = {{0}, {0}};
};

/// Runs `body` so that the random numbers it draws depend on `seed` alone
/// (see the Note above). When `body` turns out to have drawn unseeded,
/// `rerun` runs instead under the exclusive lease with the generators
/// seeded; it must redo `body`'s work, replacing its results.
RandomOutcome run_seeded(
    RandomUse& use,
    torch::Device device,
    bool training,
    uint64_t seed,
    const std::function<void()>& body,
    const std::function<void()>& rerun);

/// Runs `body` (a recomputation) drawing what the forward whose outcome is
/// `forward` drew. Throws `c10::Error` when it cannot: the numbers differ.
/// When the forward drew nothing and the default generators moved while
/// `body` ran, it runs again (so it must redo its work from the start,
/// replacing its results) on a generator of its own, to tell whether the
/// cell drew or another thread did (Note [A recomputation that saw the
/// generators move] in random.cpp).
void replay_seeded(
    torch::Device device,
    uint64_t seed,
    const RandomOutcome& forward,
    const std::function<void()>& body);

/// Mixes a step seed with a cell's coordinates.
uint64_t cell_seed(uint64_t step_seed, int64_t micro_batch, int64_t stage);

/// The default CPU generator's state, and setting it, under the exclusive
/// lease (so never in the middle of a cell's draws).
torch::Tensor cpu_generator_state();
void set_cpu_generator_state(const torch::Tensor& state);

/// A step seed, drawn from the default CPU generator under the exclusive
/// lease (see the Note above).
uint64_t draw_step_seed();

class CellGeneratorScope;  // cell_generator.h

/// While alive, profiling (balance's and autotune's) on this thread draws
/// from a stream of its own, seeded with a seed no other use in this process
/// gets, and nothing of the user's stream. Profiling on the CPU takes a
/// generator of its own for this thread's random operators (as a cell
/// does, cell_generator.h), so the default generator does not move and
/// pipelines on other threads, which watch it, are undisturbed. Elsewhere
/// (a CUDA device, or no generators of its own) the default CPU generator
/// is set aside instead: reseeded, and the user's state put back when it
/// goes (both under the exclusive lease), which hands out no number twice
/// whatever other threads draw meanwhile; nested and overlapping ones (two
/// threads profiling) share one aside, the first sets it, the last puts the
/// user's state back. Refused inside a cell, which holds the lease.
class CpuGeneratorAside {
 public:
  explicit CpuGeneratorAside(torch::Device device);
  ~CpuGeneratorAside();
  CpuGeneratorAside(const CpuGeneratorAside&) = delete;
  CpuGeneratorAside& operator=(const CpuGeneratorAside&) = delete;

 private:
  std::unique_ptr<CellGeneratorScope> own_;  // set: no aside was taken
};

}  // namespace gpipe::detail
