// Training checkpoints on disk: see checkpoint_io.h.

#include "checkpoint_io.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

namespace gpipe::detail {

namespace fs = std::filesystem;

namespace {

const std::vector<c10::ScalarType>& saved_dtypes() {
  static const std::vector<c10::ScalarType> dtypes{
      c10::kFloat,
      c10::kDouble,
      c10::kHalf,
      c10::kBFloat16,
      c10::kLong,
      c10::kInt,
      c10::kShort,
      c10::kChar,
      c10::kByte,
      c10::kBool};
  return dtypes;
}

c10::ScalarType dtype_named(const std::string& name, const std::string& key) {
  for (auto t : saved_dtypes()) {
    if (name == c10::toString(t)) {
      return t;
    }
  }
  TORCH_CHECK_VALUE(
      false, "the checkpoint's tensor '", key, "' has unknown dtype ", name);
}

}  // namespace

int64_t step_of(const std::string& name) {
  constexpr const char* kPrefix = "step-";
  if (name.rfind(kPrefix, 0) != 0 || name.size() == 5 ||
      !std::all_of(
          name.begin() + 5,
          name.end(),
          [](char c) { return c >= '0' && c <= '9'; }) ||
      name.size() > 5 + 18) {
    return -1;
  }
  return std::stoll(name.substr(5));
}

std::string checkpoint_dir_name(int64_t step) {
  std::ostringstream out;
  out << "step-" << std::setw(8) << std::setfill('0') << step;
  return out.str();
}

bool is_saved_dtype(c10::ScalarType dtype) {
  const auto& all = saved_dtypes();
  return std::find(all.begin(), all.end(), dtype) != all.end();
}

void Checksum::add(const uint8_t* data, size_t n) {
  count_ += n;
  while (n > 0 && filled_ > 0) {
    carry_[filled_++] = *data++;
    --n;
    if (filled_ == 8) {
      hash_ = step(hash_, carry_);
      filled_ = 0;
    }
  }
  for (; n >= 8; n -= 8, data += 8) {
    hash_ = step(hash_, data);
  }
  while (n-- > 0) {
    carry_[filled_++] = *data++;
  }
}

std::string Checksum::hex() const {
  uint64_t hash = hash_;
  if (filled_ > 0) {
    uint8_t last[8] = {0};
    std::memcpy(last, carry_, filled_);
    hash = step(hash, last);
  }
  hash = (hash ^ count_) * kPrime;
  std::ostringstream out;
  out << std::hex << std::setw(16) << std::setfill('0') << hash;
  return out.str();
}

std::string manifest_checksum(nlohmann::json manifest) {
  manifest.erase(kManifestChecksumKey);
  const auto text = manifest.dump();
  Checksum checksum;
  checksum.add(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  return checksum.hex();
}

uint64_t Checksum::step(uint64_t hash, const uint8_t* bytes) {
  uint64_t word = 0;
  std::memcpy(&word, bytes, sizeof(word));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  word = __builtin_bswap64(word);
#endif
  return (hash ^ word) * kPrime;
}

// The whole checkpoints in `root`, oldest first.
std::vector<std::pair<int64_t, fs::path>> checkpoints_in(
    const std::string& root) {
  std::map<int64_t, fs::path> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const auto name = entry.path().filename().string();
    // An older checkpoint of a step being written again, moved aside, is
    // that step's while the new one is not in place.
    const bool aside = name.rfind(".old-", 0) == 0;
    const auto step = step_of(aside ? name.substr(5) : name);
    if (step >= 0 && fs::is_regular_file(entry.path() / kManifest, error) &&
        (!aside || found.count(step) == 0)) {
      found[step] = entry.path();
    }
  }
  return {found.begin(), found.end()};
}

void add_file(
    nlohmann::json& manifest,
    const std::string& name,
    const nlohmann::json& written) {
  manifest["files"][name] = {
      {"bytes", written.at("bytes")}, {kChecksumKey, written.at(kChecksumKey)}};
  for (const auto& item : written.at("tensors").items()) {
    TORCH_CHECK(
        !manifest["tensors"].contains(item.key()),
        "two files of one checkpoint hold tensor '",
        item.key(),
        "'");
    auto entry = item.value();
    entry["file"] = name;
    manifest["tensors"][item.key()] = std::move(entry);
  }
}

nlohmann::json state_to_json(const TrainingState& state) {
  // Counts of what was done: a negative one is a mistake (an unset -1)
  // that a resumed run would read back as where to go on from.
  TORCH_CHECK_VALUE(
      state.epoch >= 0 && state.position >= 0,
      "TrainingState expects epoch and position >= 0 (epochs done, and the "
      "position in the data within the epoch), but got epoch ",
      state.epoch,
      " and position ",
      state.position);
  // The manifest is JSON text: a string that is not UTF-8 cannot go in it
  // (nlohmann's own error would not be a c10::Error, and would come after
  // the checkpoint's directory was made).
  for (const auto& [key, value] : state.user) {
    for (const auto* text : {&key, &value}) {
      try {
        (void)nlohmann::json(*text).dump();
      } catch (const std::exception&) {
        TORCH_CHECK_VALUE(
            false,
            "TrainingState::user['",
            key.size() > 40 ? key.substr(0, 40) + "..." : key,
            "']: its ",
            text == &key ? "key" : "value",
            " is not valid UTF-8 text, but the checkpoint's manifest keeps "
            "text only; store bytes as hex or base64");
      }
    }
  }
  return {
      {"step", state.step},
      {"epoch", state.epoch},
      {"position", state.position},
      {"user", state.user}};
}

TrainingState state_from_json(const nlohmann::json& json) {
  TrainingState state;
  state.step = json.at("step").get<int64_t>();
  state.epoch = json.at("epoch").get<int64_t>();
  state.position = json.at("position").get<int64_t>();
  state.user = json.at("user").get<std::map<std::string, std::string>>();
  return state;
}

CheckpointReader::CheckpointReader(const std::string& dir) {
  path_ = latest_checkpoint(dir);
  TORCH_CHECK_VALUE(
      !path_.empty(),
      "there is no checkpoint in '",
      dir,
      "': expected a directory written by gpipe::save_checkpoint (holding ",
      "step-<n>/",
      kManifest,
      ") or one checkpoint (holding ",
      kManifest,
      ")");
  const auto path = (fs::path(path_) / kManifest).string();
  std::ifstream in(path);
  TORCH_CHECK_VALUE(in, "cannot read '", path, "'");
  // Whether it is a manifest of this format and version, then whether it
  // is whole: every entry the reader will use is checked here.
  const auto damaged = [&](const std::exception& e) {
    std::string why = e.what();
    if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
      why = error->what_without_backtrace();
    }
    TORCH_CHECK_VALUE(
        false,
        "'",
        path,
        "' is not a whole gpipe checkpoint manifest (",
        why,
        "): the checkpoint is damaged");
  };
  int64_t version = 0;
  try {
    manifest_ = nlohmann::json::parse(in);
    TORCH_CHECK_VALUE(
        manifest_.at("format").get<std::string>() == kCheckpointFormat,
        "format is not ",
        kCheckpointFormat);
    version = manifest_.at("version").get<int64_t>();
    // The data files' checksums and places are in the manifest: a manifest
    // changed after it was written would read them wrong.
    // (Every manifest is written with one; one without it was changed.)
    TORCH_CHECK_VALUE(
        manifest_.contains(kManifestChecksumKey),
        "it has no checksum of itself ('",
        kManifestChecksumKey,
        "'; every gpipe since 2026-11-29 writes one)");
    TORCH_CHECK_VALUE(
        manifest_.at(kManifestChecksumKey).get<std::string>() ==
            manifest_checksum(manifest_),
        "it does not match the checksum it was written with");
  } catch (const std::exception& e) {
    damaged(e);
  }
  TORCH_CHECK_VALUE(
      version == kCheckpointVersion,
      "'",
      path,
      "' is of checkpoint format version ",
      version,
      ", but this gpipe reads version ",
      kCheckpointVersion);
  try {
    for (const auto& item : manifest_.at("files").items()) {
      item.value().at("bytes").get<int64_t>();
      item.value().at(kChecksumKey).get<std::string>();
    }
    for (const auto& item : manifest_.at("tensors").items()) {
      const auto& entry = item.value();
      TORCH_CHECK_VALUE(
          manifest_["files"].contains(entry.at("file").get<std::string>()),
          "tensor '",
          item.key(),
          "' is in a file the manifest does not list");
      entry.at("offset").get<int64_t>();
      dtype_named(entry.at("dtype").get<std::string>(), item.key());
      entry.at("shape").get<std::vector<int64_t>>();
    }
    manifest_.at("layers").get<std::vector<std::string>>();
    manifest_.at("state").at("user").get<std::map<std::string, std::string>>();
    state_from_json(manifest_.at("state"));
  } catch (const std::exception& e) {
    damaged(e);
  }
}

bool CheckpointReader::has(const std::string& key) const {
  return manifest_["tensors"].contains(key);
}

std::vector<std::string> CheckpointReader::keys_with_prefix(
    const std::string& prefix) const {
  std::vector<std::string> keys;
  for (const auto& item : manifest_["tensors"].items()) {
    if (item.key().rfind(prefix, 0) == 0) {
      keys.push_back(item.key());
    }
  }
  return keys;
}

torch::Tensor CheckpointReader::tensor(const std::string& key) {
  TORCH_CHECK_VALUE(
      has(key), "the checkpoint in '", path_, "' has no tensor '", key, "'");
  const auto& entry = manifest_["tensors"][key];
  const auto file = entry.at("file").get<std::string>();
  auto it = files_.find(file);
  if (it == files_.end()) {
    const auto path = (fs::path(path_) / file).string();
    TORCH_CHECK_VALUE(
        manifest_["files"].contains(file),
        "the checkpoint's manifest names file '",
        file,
        "' for tensor '",
        key,
        "' but does not list it");
    const auto& listed = manifest_["files"][file];
    const auto bytes = listed.at("bytes").get<int64_t>();
    std::error_code error;
    const auto size = fs::file_size(path, error);
    std::error_code ignored;
    TORCH_CHECK_VALUE(
        !error || !fs::exists(path, ignored),
        "the checkpoint's file '",
        path,
        "' cannot be read (",
        fs::is_directory(path, ignored) ? std::string("it is a directory")
                                        : error.message(),
        ")");
    TORCH_CHECK_VALUE(!error, "the checkpoint's file '", path, "' is missing");
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(size) == bytes,
        "the checkpoint's file '",
        path,
        "' has ",
        size,
        " bytes, but its manifest says ",
        bytes,
        ": it is truncated or was overwritten");
    auto data = torch::empty({bytes}, torch::kUInt8);
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(data.data_ptr()), bytes);
    TORCH_CHECK_VALUE(in, "cannot read '", path, "'");
    Checksum checksum;
    checksum.add(data.data_ptr<uint8_t>(), static_cast<size_t>(bytes));
    const auto sum = checksum.hex();
    TORCH_CHECK_VALUE(
        sum == listed.at(kChecksumKey).get<std::string>(),
        "the checkpoint's file '",
        path,
        "' is corrupt: its checksum is ",
        sum,
        ", but its manifest says ",
        listed.at(kChecksumKey).get<std::string>());
    it = files_.emplace(file, data).first;
  }
  const auto dtype = dtype_named(entry.at("dtype").get<std::string>(), key);
  const auto shape = entry.at("shape").get<std::vector<int64_t>>();
  const auto offset = entry.at("offset").get<int64_t>();
  int64_t numel = 1;
  for (auto s : shape) {
    numel *= s;
  }
  const auto nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK_VALUE(
      offset >= 0 && offset % kAlign == 0 &&
          offset + nbytes <= it->second.numel(),
      "the checkpoint's tensor '",
      key,
      "' lies outside its file '",
      file,
      "'");
  return it->second.narrow(0, offset, nbytes).view(dtype).view(shape);
}

}  // namespace gpipe::detail

namespace gpipe {

namespace fs = std::filesystem;

std::string latest_checkpoint(const std::string& dir) {
  std::error_code error;
  if (fs::is_regular_file(fs::path(dir) / detail::kManifest, error)) {
    return dir;
  }
  // A `step-<n>` appears by one rename once it is whole, and goes by one
  // (Note [Writing a checkpoint], Note [Removing a checkpoint beside
  // readers]): the newest without a manifest was damaged, and going on
  // from an older one, or from nothing, would redo its steps unsaid. The
  // names are listed before the whole ones, so that one written in between
  // is whole; one taken away in between is looked for again.
  for (int attempt = 0;; ++attempt) {
    int64_t newest = -1;
    fs::path newest_path;
    for (const auto& entry : fs::directory_iterator(dir, error)) {
      const auto step = detail::step_of(entry.path().filename().string());
      if (step > newest) {
        newest = step;
        newest_path = entry.path();
      }
    }
    auto all = detail::checkpoints_in(dir);
    if (newest < 0 || (!all.empty() && all.back().first >= newest)) {
      return all.empty() ? std::string() : all.back().second.string();
    }
    if (attempt < 8 && !fs::exists(newest_path, error)) {
      continue;
    }
    const auto going_on = all.empty() ? std::string("nothing saved")
                                      : "'" + all.back().second.string() + "'";
    // A file of a checkpoint's name (a stray `touch`, a copy gone wrong)
    // was never one.
    TORCH_CHECK_VALUE(
        fs::is_directory(newest_path, error) || !fs::exists(newest_path, error),
        "'",
        newest_path.string(),
        "' is a file, not a checkpoint (a directory, with a ",
        detail::kManifest,
        "); remove it to go on from ",
        going_on);
    TORCH_CHECK_VALUE(
        false,
        "'",
        newest_path.string(),
        "' is not a whole checkpoint (it has no ",
        detail::kManifest,
        "): it was damaged after it was written; remove it to go on from ",
        going_on);
  }
}

}  // namespace gpipe
