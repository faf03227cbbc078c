#pragma once

// Skip connections: a layer stashes a tensor that a later layer pops, maybe
// on another partition.
//
// A layer that stashes or pops derives from `gpipe::Skippable` besides
// `torch::nn::Module`, declares its names in the constructor, and calls
// `stash(name, tensor)` / `pop(name)` in its forward:
//
// ```
// struct StashImpl : torch::nn::Module, gpipe::Skippable {
//   StashImpl() : gpipe::Skippable(/*stash=*/{"skip"}, /*pop=*/{}) {}
//   torch::Tensor forward(torch::Tensor x) {
//     stash("skip", x);
//     return x;
//   }
// };
// TORCH_MODULE(Stash);
//
// struct PopAddImpl : torch::nn::Module, gpipe::Skippable {
//   PopAddImpl() : gpipe::Skippable({}, {"skip"}) {}
//   torch::Tensor forward(torch::Tensor x) {
//     return x + pop("skip");
//   }
// };
// TORCH_MODULE(PopAdd);
// ```
//
// Inside `gpipe::GPipe` the engine carries a stashed tensor straight from the
// stashing partition to the popping one (copying it across devices when they
// differ) and its gradient back the same way. In a plain Sequential (or any
// code outside GPipe) stash and pop go through a per-thread table, so the same
// layers run unchanged; a forward that throws between a stash and its pop
// leaves the tensor in that table (`clear_stashed_skips`).
//
// Each name must be stashed by one layer and popped by one later layer of the
// Sequential. A block used more than once puts its names in a `Namespace` of
// its own with `isolate`.

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace gpipe {

/// Keeps skip names of different blocks apart. A default-constructed
/// Namespace is new and unique; copies compare equal to the original.
class Namespace {
 public:
  Namespace();
  /// The namespace of names no `isolate` touched.
  static Namespace global();

  uint64_t id() const {
    return id_;
  }
  bool operator==(const Namespace& other) const {
    return id_ == other.id_;
  }
  bool operator!=(const Namespace& other) const {
    return id_ != other.id_;
  }
  bool operator<(const Namespace& other) const {
    return id_ < other.id_;
  }

 private:
  explicit Namespace(uint64_t id) : id_(id) {}
  uint64_t id_;
};

/// A skip's full name: its namespace and the name the layer uses.
struct SkipKey {
  Namespace ns;
  std::string name;

  bool operator==(const SkipKey& other) const {
    return ns == other.ns && name == other.name;
  }
  bool operator<(const SkipKey& other) const {
    return ns < other.ns || (ns == other.ns && name < other.name);
  }
};

/// `'name'`, or `'name'` in namespace 3.
std::ostream& operator<<(std::ostream& stream, const SkipKey& key);

/// Mix-in for a layer that stashes tensors for later layers or pops tensors
/// stashed by earlier ones. See the example at the top of this header.
class Skippable {
 public:
  /// Declares the names this layer stashes and the names it pops.
  Skippable(std::vector<std::string> stash, std::vector<std::string> pop);
  virtual ~Skippable();
  Skippable(const Skippable&) = default;
  Skippable& operator=(const Skippable&) = default;

  /// Puts the declared names (all of them, or those in `only`) in `ns`, so
  /// that another instance of the same block can use the same names.
  /// Returns this layer, for chaining.
  Skippable& isolate(
      const Namespace& ns, const std::vector<std::string>& only = {});

  /// The names declared as stashed / popped, in declaration order.
  const std::vector<std::string>& stashable_names() const {
    return stash_names_;
  }
  const std::vector<std::string>& poppable_names() const {
    return pop_names_;
  }
  /// The full name of `name` (its namespace as set by `isolate`).
  SkipKey key(const std::string& name) const;
  /// Full names of the declared stashes / pops.
  std::vector<SkipKey> stashable() const;
  std::vector<SkipKey> poppable() const;

 protected:
  /// Stashes `tensor` (may be undefined: then the pop gets an undefined
  /// tensor and no gradient flows) under `name`, which must be declared.
  /// Throws `c10::Error` if `name` was not declared as stashed.
  void stash(const std::string& name, torch::Tensor tensor);
  /// Pops the tensor stashed under `name`, which must be declared. Throws
  /// `c10::Error` if `name` was not declared as popped, or nothing was
  /// stashed under it.
  torch::Tensor pop(const std::string& name);

 private:
  std::vector<std::string> stash_names_;
  std::vector<std::string> pop_names_;
  std::map<std::string, Namespace> namespaces_;
};

/// The Skippable behind `module`, or nullptr if it does not derive from one.
const Skippable* as_skippable(const torch::nn::Module& module);

/// Checks statically that every skip of `module` is stashed by exactly one
/// layer and popped by exactly one later layer, and that a name is reused
/// only in another namespace. Throws `c10::TypeError` listing every problem.
/// `gpipe::GPipe` calls it on construction.
void verify_skippables(const torch::nn::Sequential& module);

/// Outside GPipe, drops what this thread's table of stashed skips still
/// holds and returns how many it dropped. A forward that throws between a
/// stash and its pop leaves the stashed tensor there, and the next pop of
/// that name on this thread (in any model) would take it; call this where
/// such an error is caught. (Inside GPipe each cell has a table of its own,
/// and a failed step leaves nothing behind.)
int64_t clear_stashed_skips();

}  // namespace gpipe
