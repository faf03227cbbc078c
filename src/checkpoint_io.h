#pragma once

// Training checkpoints on disk (see gpipe/checkpoint_io.h for what users
// see): files of raw tensors with a checksum each, a manifest that names
// every tensor, and the directory dance that makes a checkpoint appear
// whole or not at all. What goes into the files (a model's layers and its
// optimizer's state) is checkpoint_state.cpp's; who writes which file
// (each rank its own) is the caller's.

#include <gpipe/checkpoint_io.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// The checkpoint format's name and version, in every manifest.
constexpr const char* kCheckpointFormat = "gpipe-checkpoint";
constexpr int64_t kCheckpointVersion = 1;
/// The largest step a checkpoint's directory name (`step-` and at most 18
/// digits) holds.
constexpr int64_t kMaxCheckpointStep = 999999999999999999;
constexpr const char* kManifest = "manifest.json";

/// Tensors start at multiples of this in their file, so that a file's
/// bytes can be viewed as any dtype.
constexpr int64_t kAlign = 64;

/// The manifest's key of a file's checksum, and the checksum: FNV-1a over
/// the file's bytes taken 8 at a time as little-endian 64-bit words (the
/// last, short word padded with zeros), then the byte count mixed in. A
/// word at a time keeps it well under the cost of reading the file. Fed in
/// pieces of any size.
constexpr const char* kChecksumKey = "fnv1a64_words";
/// The manifest's key of its own checksum: `Checksum` over the compact dump
/// of the manifest without this key (nlohmann::json keeps keys sorted, so
/// the dump of what was parsed is the dump of what was written). A manifest
/// without it (written before manifests carried one) is read unchecked.
constexpr const char* kManifestChecksumKey = "manifest_fnv1a64_words";
std::string manifest_checksum(nlohmann::json manifest);
class Checksum {
 public:
  void add(const uint8_t* data, size_t n);
  std::string hex() const;

 private:
  static constexpr uint64_t kPrime = 1099511628211ULL;
  static uint64_t step(uint64_t hash, const uint8_t* bytes);
  uint64_t hash_ = 14695981039346656037ULL;
  uint64_t count_ = 0;
  uint8_t carry_[8] = {0};
  size_t filled_ = 0;
};

/// Whether tensors of `dtype` can be saved.
bool is_saved_dtype(c10::ScalarType dtype);

/// The directory name of the checkpoint of `step` (`step-<n>`, n in at
/// least 8 digits).
std::string checkpoint_dir_name(int64_t step);
/// `step-<n>` as n, or -1 for any other name.
int64_t step_of(const std::string& name);

/// Writes `tensors` (any device) into `dir/name` and flushes it to disk.
/// Returns the file's manifest entry: its size, checksum and, per tensor,
/// its offset, dtype and shape.
nlohmann::json write_tensor_file(
    const std::string& dir,
    const std::string& name,
    const NamedTensors& tensors);

/// Adds the file `name`, as write_tensor_file described it (`written`),
/// and its tensors to `manifest`.
void add_file(
    nlohmann::json& manifest,
    const std::string& name,
    const nlohmann::json& written);

/// The whole checkpoints in `root` (`step-<n>` with a manifest), oldest
/// first.
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints_in(
    const std::string& root);

/// Removes `path` and everything under it (a symbolic link is removed, not
/// followed); a path that does not exist is no error. Returns what failed,
/// or "" (Note [Removing a directory tree]).
std::string remove_tree(const std::string& path);

/// Makes a fresh temporary directory in `root` (made when missing) for the
/// checkpoint of `step`, and returns its path. Leftovers of writes that
/// never finished go.
std::string begin_checkpoint(const std::string& root, int64_t step);

/// Writes `manifest` (with the format's name and version added) into `tmp`
/// and flushes it, then renames `tmp` to `root/step-<step>` (replacing an
/// older checkpoint of that step) and removes all but the two newest
/// checkpoints.
void commit_checkpoint(
    const std::string& root,
    const std::string& tmp,
    int64_t step,
    nlohmann::json manifest);

/// The manifest's "state" for `state` (its generator state goes into a
/// file as tensor "random.cpu"), and back.
nlohmann::json state_to_json(const TrainingState& state);
TrainingState state_from_json(const nlohmann::json& state);

/// A checkpoint opened for reading: the manifest read and checked; each file
/// read and checked against its checksum the first time one of its tensors
/// is asked for.
class CheckpointReader {
 public:
  /// Opens `dir`'s newest checkpoint (or `dir` itself when it holds a
  /// manifest). A c10::ValueError names the path and what is wrong.
  explicit CheckpointReader(const std::string& dir);

  const std::string& path() const {
    return path_;
  }
  const nlohmann::json& manifest() const {
    return manifest_;
  }
  bool has(const std::string& key) const;
  /// The saved tensor `key` on the CPU, in its saved dtype; it shares its
  /// file's memory (copy it into place).
  torch::Tensor tensor(const std::string& key);
  /// The keys that start with `prefix`.
  std::vector<std::string> keys_with_prefix(const std::string& prefix) const;

 private:
  std::string path_;
  nlohmann::json manifest_;
  std::map<std::string, torch::Tensor> files_;  // file name -> its bytes
};

/// For tests: the writer fails as a crash would after `writes` more
/// steps (a directory made, a file written or flushed, a rename); -1 (the
/// default) never.
void fail_checkpoint_after(int64_t writes);

/// For tests: remove_tree fails (as on a tree the user may not change)
/// while `fail` is true.
void fail_checkpoint_removals(bool fail);

}  // namespace gpipe::detail
