// gpipe-bench --only random: what the engine's random-number bookkeeping
// costs each cell, measured on the primitives the stage calls around every
// cell's body (see src/random.h).

#include "random.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "sections.h"

namespace gpipe::bench {

namespace {

// Seconds per call of `fn`, the median of 9 rounds of `calls` calls.
template <typename F>
double per_call(F&& fn, int calls) {
  std::vector<double> rounds;
  for (int r = 0; r < 9; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < calls; ++k) {
      fn(k);
    }
    rounds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count() /
        calls);
  }
  std::nth_element(rounds.begin(), rounds.begin() + 4, rounds.end());
  return rounds[4];
}

}  // namespace

nlohmann::json random_section() {
  using detail::RandomUse;
  std::printf(
      "\n# random numbers: engine cost per cell around the cell's body\n");
  std::printf("%-46s %10s\n", "path", "ns/cell");
  const torch::Device cpu(torch::kCPU);
  auto nothing = [] {};
  auto draw = [] { torch::rand({1}); };
  const int calls = 20000;
  const double bare = per_call([&](int) { nothing(); }, calls);
  const double bare_draw = per_call([&](int) { draw(); }, calls);
  // A stage that has learnt it draws nothing: shared lease and two
  // generator snapshots.
  RandomUse quiet;
  detail::run_seeded(quiet, cpu, true, 1, nothing, nothing);
  const double shared = per_call(
      [&](int k) { detail::run_seeded(quiet, cpu, true, k, nothing, nothing); },
      calls);
  // A stage that draws: on the CPU a generator of its own (seeded), the
  // shared lease, snapshots of it and of the default generator.
  RandomUse drawing;
  const double exclusive = per_call(
      [&](int k) { detail::run_seeded(drawing, cpu, true, k, draw, draw); },
      calls);
  const double shared_cost = shared - bare;
  const double exclusive_cost = exclusive - bare_draw;
  std::printf(
      "%-46s %10.0f\n",
      "cell that draws nothing (shared lease)",
      shared_cost * 1e9);
  std::printf(
      "%-46s %10.0f\n",
      "cell that draws (own generator, shared lease)",
      exclusive_cost * 1e9);
  return {
      {"shared_seconds_per_cell", shared_cost},
      {"drawing_seconds_per_cell", exclusive_cost}};
}

}  // namespace gpipe::bench
