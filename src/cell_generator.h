#pragma once

// A cell's own random generator on the CPU (Note [Random streams of
// concurrent cells] in random.h): while a CellGeneratorScope lives, the
// random operators its thread calls without a generator (dropout's
// bernoulli_, rand, randn, randperm, ...) draw from the cell's generator
// instead of LibTorch's default one, so cells that draw can run at once.

#include <ATen/core/Generator.h>

namespace gpipe::detail {

/// Whether the random operators can be given a cell's generator: true once
/// gpipe has put its kernels in the dispatcher (the first call does it, so
/// make it before threads of ours dispatch: Pipeline's constructor does);
/// false when another library already holds the dispatch key they use
/// (c10::DispatchKey::TESTING_ONLY_GenericMode, see cell_generator.cpp),
/// and then cells that draw take the default generators in turn.
bool cell_generators_available();

/// While alive, the random operators this thread calls without a generator
/// draw from `cpu` (a CPU generator); operators given a generator keep it.
/// Scopes nest. Needs cell_generators_available().
class CellGeneratorScope {
 public:
  explicit CellGeneratorScope(at::Generator cpu);
  ~CellGeneratorScope();
  CellGeneratorScope(const CellGeneratorScope&) = delete;
  CellGeneratorScope& operator=(const CellGeneratorScope&) = delete;

 private:
  at::Generator* previous_;
  at::Generator generator_;
  bool included_before_;
};

}  // namespace gpipe::detail
