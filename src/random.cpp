#include "random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "cell_generator.h"

namespace gpipe::detail {

namespace {

// How many more times a recomputation runs on a generator of its own while
// the default generator moves (Note [A recomputation that saw the
// generators move]); a forward runs once more.
constexpr int kTries = 3;

std::vector<torch::Device> generator_devices(torch::Device device) {
  std::vector<torch::Device> devices{torch::kCPU};
  if (device.type() != torch::kCPU) {
    devices.push_back(device);
  }
  return devices;
}

at::Generator generator_of(torch::Device device) {
  return at::globalContext().defaultGenerator(device);
}

void seed_generators(torch::Device device, uint64_t seed) {
  for (const auto& d : generator_devices(device)) {
    auto gen = generator_of(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct Shared {
  Shared() {
    RandomLease::get().lock_shared();
  }
  ~Shared() {
    RandomLease::get().unlock_shared();
  }
};

struct Exclusive {
  Exclusive() {
    RandomLease::get().lock();
  }
  ~Exclusive() {
    RandomLease::get().unlock();
  }
};

// Puts the default generators back where `saved` found them when it goes,
// thrown or not.
struct RestoreOnExit {
  const GeneratorSnapshot& saved;
  ~RestoreOnExit() {
    saved.restore();
  }
};

// Runs `body` exclusively with the generators seeded; returns whether it
// drew and where the generators ended.
RandomOutcome run_exclusive(
    torch::Device device, uint64_t seed, const std::function<void()>& body) {
  Exclusive hold;
  // The user's streams, which the seeding below must not cost them.
  const GeneratorSnapshot user(device);
  const RestoreOnExit put_back{user};
  seed_generators(device, seed);
  const GeneratorSnapshot before(device);
  body();
  auto end = std::make_shared<GeneratorSnapshot>(device);
  RandomOutcome outcome;
  outcome.drew = *end != before;
  if (outcome.drew) {
    outcome.end = std::move(end);
  }
  return outcome;
}

// Runs `body` under the shared lease with a CPU generator of its own,
// seeded with `seed`, for the random operators it calls (cell_generator.h).
// `moved` says whether the default generators moved meanwhile (a layer that
// draws from them by name, or another thread's draws): then the outcome
// counts for nothing and the caller runs the cell exclusively instead.
struct OwnRun {
  RandomOutcome outcome;
  bool moved = false;
};

OwnRun run_own(uint64_t seed, const std::function<void()>& body) {
  Shared hold;
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const GeneratorSnapshot start(gen);
  const GeneratorSnapshot before(torch::kCPU);
  {
    CellGeneratorScope scope(gen);
    body();
  }
  OwnRun run;
  run.moved = GeneratorSnapshot(torch::kCPU) != before;
  auto end = std::make_shared<GeneratorSnapshot>(gen);
  run.outcome.drew = *end != start;
  run.outcome.own = true;
  if (run.outcome.drew) {
    run.outcome.end = std::move(end);
  }
  return run;
}

// Whether cells on `device` draw from generators of their own.
bool own_generators(torch::Device device) {
  return device.is_cpu() && cell_generators_available();
}

}  // namespace

RandomLease& RandomLease::get() {
  static RandomLease lease;
  return lease;
}

void RandomLease::lock_shared() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return !writer_ && writers_waiting_ == 0; });
  ++readers_;
}

void RandomLease::unlock_shared() {
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = --readers_ == 0;
  }
  if (last) {
    cv_.notify_all();
  }
}

void RandomLease::lock() {
  std::unique_lock<std::mutex> lock(mutex_);
  ++writers_waiting_;
  cv_.wait(lock, [this] { return !writer_ && readers_ == 0; });
  --writers_waiting_;
  writer_ = true;
}

void RandomLease::unlock() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    writer_ = false;
  }
  cv_.notify_all();
}

GeneratorSnapshot::GeneratorSnapshot(const at::Generator& cpu) {
  auto gen = cpu;
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  cpu_.engine = impl->engine().data();
  cpu_.next_float = impl->next_float_normal_sample();
  cpu_.next_double = impl->next_double_normal_sample();
}

GeneratorSnapshot::GeneratorSnapshot(torch::Device device) {
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    cpu_.engine = impl->engine().data();
    // A normal sample can come from the Box-Muller cache alone.
    cpu_.next_float = impl->next_float_normal_sample();
    cpu_.next_double = impl->next_double_normal_sample();
  }
  if (device.type() != torch::kCPU) {
    auto gen = generator_of(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    device_ = gen.get_state();
    other_ = device;
  }
}

GeneratorSnapshot::~GeneratorSnapshot() = default;

void GeneratorSnapshot::restore() const {
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    auto engine = impl->engine();
    engine.set_data(cpu_.engine);
    impl->set_engine(engine);
    impl->set_next_float_normal_sample(cpu_.next_float);
    impl->set_next_double_normal_sample(cpu_.next_double);
  }
  if (other_) {
    auto gen = generator_of(*other_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(device_);
  }
}

bool GeneratorSnapshot::operator==(const GeneratorSnapshot& other) const {
  const auto& a = cpu_.engine;
  const auto& b = other.cpu_.engine;
  if (a.seed_ != b.seed_ || a.left_ != b.left_ || a.seeded_ != b.seeded_ ||
      a.next_ != b.next_ || a.state_ != b.state_ ||
      cpu_.next_float != other.cpu_.next_float ||
      cpu_.next_double != other.cpu_.next_double) {
    return false;
  }
  if (device_.defined() != other.device_.defined()) {
    return false;
  }
  return !device_.defined() ||
         (device_.nbytes() == other.device_.nbytes() &&
          std::memcmp(
              device_.data_ptr(), other.device_.data_ptr(), device_.nbytes()) ==
              0);
}

void RandomUse::observe(bool training, bool drew, bool seeded) {
  auto& credits = credits_[training ? 1 : 0];
  if (drew) {
    credits.store(kPatience, std::memory_order_relaxed);
  } else if (seeded) {
    const int c = credits.load(std::memory_order_relaxed);
    credits.store(std::max(0, c - 1), std::memory_order_relaxed);
  }
}

namespace {

// Runs a cell that draws, seeded, and records what it drew: `first` on a
// generator of its own where it may (`own`) and, when the default
// generators moved meanwhile, `rerun` in turn; else `first` in turn.
RandomOutcome run_drawing(
    RandomUse& use,
    torch::Device device,
    bool training,
    uint64_t seed,
    bool own,
    const std::function<void()>& first,
    const std::function<void()>& rerun) {
  RandomOutcome outcome;
  if (!own) {
    outcome = run_exclusive(device, seed, first);
  } else if (auto run = run_own(seed, first); !run.moved) {
    outcome = std::move(run.outcome);
  } else {
    // The default generator moved: the cell drew from it by name, or
    // another thread drew meanwhile (Note [A recomputation that saw the
    // generators move]). Again on a generator of its own, once: a move in
    // both runs is the cell's (whose draws by name each run moves the
    // user's stream further): again, in turn.
    run = run_own(seed, rerun);
    if (!run.moved) {
      outcome = std::move(run.outcome);
    } else {
      use.observe_by_name(training);
      outcome = run_exclusive(device, seed, rerun);
    }
  }
  use.observe(training, outcome.drew, /*seeded=*/true);
  return outcome;
}

}  // namespace

RandomOutcome run_seeded(
    RandomUse& use,
    torch::Device device,
    bool training,
    uint64_t seed,
    const std::function<void()>& body,
    const std::function<void()>& rerun) {
  const bool available = own_generators(device);
  const bool in_turn = available && use.draws_by_name(training);
  if (in_turn) {
    use.ran_in_turn(training);
  }
  const bool own = available && !in_turn;
  if (use.expect_draws(training)) {
    return run_drawing(use, device, training, seed, own, body, rerun);
  }
  bool moved = false;
  {
    Shared hold;
    const GeneratorSnapshot before(device);
    body();
    moved = GeneratorSnapshot(device) != before;
  }
  if (!moved) {
    return RandomOutcome{};
  }
  // This cell, or another of the shared group, drew unseeded: run again,
  // seeded. See Note [Random streams of concurrent cells].
  return run_drawing(use, device, training, seed, own, rerun, rerun);
}

void replay_seeded(
    torch::Device device,
    uint64_t seed,
    const RandomOutcome& forward,
    const std::function<void()>& body) {
  if (forward.drew && forward.own) {
    // Its own draws are told apart from the default generator's moves, which
    // are another thread's or the cell's by name: runs again while the
    // default generator moves (Note [A recomputation that saw the
    // generators move]).
    for (int t = 0; t <= kTries; ++t) {
      const auto run = run_own(seed, body);
      TORCH_CHECK(
          run.outcome.end && *run.outcome.end == *forward.end,
          "the recomputation of a checkpointed cell drew other random "
          "numbers than its forward (does a layer draw differently when "
          "gpipe::is_recomputing()?); its gradients would be wrong");
      if (!run.moved) {
        return;
      }
    }
    TORCH_CHECK(
        false,
        "the recomputation of a checkpointed cell saw the default random "
        "generator move in each of its ",
        kTries + 1,
        " runs, where its forward did not: a layer draws from it by name "
        "now, or another thread draws from it all the while; its gradients "
        "could be wrong");
  }
  if (forward.drew) {
    auto outcome = run_exclusive(device, seed, body);
    TORCH_CHECK(
        outcome.end && *outcome.end == *forward.end,
        "the recomputation of a checkpointed cell drew other random numbers "
        "than its forward (did another thread draw from the default "
        "generator while the pipeline ran, or does a layer draw differently "
        "when gpipe::is_recomputing()?); its gradients would be wrong");
    return;
  }
  {
    Shared hold;
    const GeneratorSnapshot before(device);
    body();
    if (GeneratorSnapshot(device) == before) {
      return;
    }
  }
  // Note [A recomputation that saw the generators move]
  // The forward drew nothing, and the default generators moved while its
  // recomputation ran: the cell drew now (its randomness changed between
  // forward and backward, and its gradients would be wrong), or another
  // thread drew meanwhile (a user's thread; the cells of other pipelines
  // draw under the lease, and profiling on its own generator). Run again
  // where the cell's own draws can be told apart: on a generator of its
  // own (CPU), whose moving means the cell drew, up to kTries times until
  // the default generators stay still: only a move in every run is an
  // error that may not be the cell's. Where cells have no generators of
  // their own (a GPU), once more, exclusively and seeded, where any move
  // counts as the cell's. The same for a cell that drew on a generator of
  // its own, in its forward (once more: a move in both runs means it draws
  // from the default generator by name, and it then runs in turn) and in its
  // recomputation (where its own generator must end where the forward's
  // did): one draw on another thread moved the default generator, and the
  // step failed.
  if (!own_generators(device)) {
    TORCH_CHECK(
        !run_exclusive(device, seed, body).drew,
        "the recomputation of a checkpointed cell drew random numbers "
        "although its forward drew none (did a layer's randomness change "
        "between forward and backward, or did another thread draw from the "
        "default generator meanwhile?); its gradients would be wrong");
    return;
  }
  for (int t = 0; t < kTries; ++t) {
    const auto run = run_own(seed, body);
    const bool drew = run.outcome.drew;
    const bool moved = run.moved;
    TORCH_CHECK(
        !drew,
        "the recomputation of a checkpointed cell drew random numbers "
        "although its forward drew none (did a layer's randomness change "
        "between forward and backward?); its gradients would be wrong");
    if (!moved) {
      return;
    }
  }
  TORCH_CHECK(
      false,
      "the recomputation of a checkpointed cell saw the default random "
      "generator move in each of its ",
      kTries + 1,
      " runs although its forward drew none: a layer draws from it by name "
      "now (its randomness changed between forward and backward), or "
      "another thread draws from it all the while; its gradients could be "
      "wrong");
}

uint64_t cell_seed(uint64_t step_seed, int64_t micro_batch, int64_t stage) {
  return splitmix64(
      splitmix64(step_seed ^ static_cast<uint64_t>(micro_batch)) ^
      (static_cast<uint64_t>(stage) << 32));
}

torch::Tensor cpu_generator_state() {
  Exclusive hold;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_generator_state(const torch::Tensor& state) {
  Exclusive hold;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

bool inside_cell();  // engine/stage.h

namespace {

// The one aside of the process: how many hold it, and the user's state.
struct Aside {
  std::mutex mutex;
  int64_t holders = 0;  // guarded by mutex
  torch::Tensor state;  // guarded by mutex
};

Aside& the_aside() {
  static Aside aside;
  return aside;
}

// A seed no other aside gets: a counter from a random start, mixed
// (splitmix64 is a bijection), unrelated to the user's stream.
uint64_t aside_seed() {
  static std::atomic<uint64_t> next{[] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }()};
  return splitmix64(next.fetch_add(1));
}

}  // namespace

CpuGeneratorAside::CpuGeneratorAside(torch::Device device) {
  // A cell holds the lease: waiting for it here would wait for itself.
  TORCH_CHECK(
      !inside_cell(),
      "gpipe: profiling (balance_by_time, balance_by_size, autotune) cannot "
      "run inside a pipeline's cell (a layer's forward or backward, or a "
      "loss); run it outside the pipeline");
  if (own_generators(device)) {
    own_ = std::make_unique<CellGeneratorScope>(
        at::make_generator<at::CPUGeneratorImpl>(aside_seed()));
    return;
  }
  auto& aside = the_aside();
  std::lock_guard<std::mutex> lock(aside.mutex);
  if (aside.holders++ > 0) {
    return;
  }
  Exclusive hold;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> gen_lock(gen.mutex());
  aside.state = gen.get_state();
  gen.set_current_seed(aside_seed());
}

CpuGeneratorAside::~CpuGeneratorAside() {
  if (own_) {
    return;
  }
  auto& aside = the_aside();
  std::lock_guard<std::mutex> lock(aside.mutex);
  if (--aside.holders > 0) {
    return;
  }
  Exclusive hold;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> gen_lock(gen.mutex());
  gen.set_state(aside.state);
  aside.state = torch::Tensor();
}

uint64_t draw_step_seed() {
  Exclusive hold;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

}  // namespace gpipe::detail
