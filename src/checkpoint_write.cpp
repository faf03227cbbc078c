// Writing training checkpoints: each file, and the directory dance that
// makes a checkpoint appear whole or not at all. See checkpoint_io.h.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "checkpoint_io.h"

namespace gpipe::detail {

namespace fs = std::filesystem;

// Note [Writing a checkpoint]
// A checkpoint must appear whole or not at all, whenever the writer dies.
// Its files go into a temporary directory in the same parent; each file is
// flushed to disk (fsync) before the manifest, which names every file with
// its size and checksum, is written and flushed last; then one rename
// makes the directory visible under its final name, and the parent is
// flushed so that the rename survives a power cut. Readers only look at
// `step-<n>` directories, so a crash before the rename leaves nothing they
// see but the older checkpoints, and the next writer removes the leftover.
// Writing a step again moves its older checkpoint aside first
// (`.old-step-<n>`), which readers take while the new one is not in place
// and the next writer puts back.
// A file damaged later (truncated, overwritten) fails its checksum when
// read, by name.

namespace {

std::atomic<int64_t> writes_left{-1};
std::atomic<bool> removals_fail{false};

// A step of writing; a test may make it fail there as a crash would.
void crash_point(const std::string& what) {
  auto left = writes_left.load();
  while (left > 0 && !writes_left.compare_exchange_weak(left, left - 1)) {
  }
  TORCH_CHECK(left != 0, "simulated crash before ", what);
}

std::string errno_text() {
  return std::strerror(errno);
}

// Where remove_entry reports the first entry it could not remove (nftw's
// callback takes no argument of the caller's).
thread_local std::string* removal_error = nullptr;

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  if (::remove(path) != 0 && errno != ENOENT) {
    *removal_error = c10::str("cannot remove '", path, "': ", errno_text());
    return 1;
  }
  return 0;
}

void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "' to flush it: ", errno_text());
  const int rc = ::fsync(fd);
  const auto why = errno_text();
  ::close(fd);
  TORCH_CHECK(rc == 0, "cannot flush '", path, "' to disk: ", why);
}

}  // namespace

// Note [Removing a directory tree]
// Not std::filesystem::remove_all: PyTorch's 2.x wheels (2.11 seen)
// link parts of a newer libstdc++ into libtorch and export them, among them
// std::filesystem's functions (pytorch/pytorch#133437). A program linked
// with that libtorch binds its own calls to those copies, and the copy of
// remove_all(path, error_code&) jumps to address 0 on a directory that
// holds files. nftw walks the tree children first, as remove_all does.
std::string remove_tree(const std::string& path) {
  if (removals_fail.load()) {
    return c10::str("cannot remove '", path, "': a simulated failure");
  }
  struct stat status {};
  if (::lstat(path.c_str(), &status) != 0) {
    return errno == ENOENT
               ? std::string()
               : c10::str("cannot remove '", path, "': ", errno_text());
  }
  std::string error;
  removal_error = &error;
  const int walked =
      ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  removal_error = nullptr;
  if (walked != 0 && error.empty()) {
    error = c10::str("cannot remove '", path, "': ", errno_text());
  }
  return error;
}

namespace {

// Note [Removing a checkpoint beside readers]
// A checkpoint is removed in two moves: a rename to `.gone-<name>`, which
// readers never look at, then the removal of that tree. A reader (an
// evaluator beside the trainer) so never meets a `step-<n>` half removed,
// which it would call damaged; one that was reading it when it went
// reads the newest again (load_checkpoint). A tree left by a removal that
// failed, or by a writer that died, goes with the next save. "" or why
// the checkpoint is still there.
std::string remove_checkpoint(const fs::path& root, const fs::path& dir) {
  if (removals_fail.load()) {
    return c10::str("cannot remove '", dir.string(), "': a simulated failure");
  }
  const auto gone = root / (".gone-" + dir.filename().string());
  (void)remove_tree(gone.string());  // a leftover of the same name
  std::error_code error;
  fs::rename(dir, gone, error);
  if (error) {
    return remove_tree(dir.string());
  }
  const auto why = remove_tree(gone.string());
  if (!why.empty()) {
    TORCH_WARN(
        "gpipe: '",
        dir.string(),
        "' was taken away as '",
        gone.string(),
        "', which could not be removed (",
        why,
        "); a later save removes it");
  }
  return "";
}

}  // namespace

void fail_checkpoint_after(int64_t writes) {
  writes_left = writes;
}

void fail_checkpoint_removals(bool fail) {
  removals_fail = fail;
}

namespace {

// A file descriptor closed when it goes, whatever is thrown.
class OpenFile {
 public:
  explicit OpenFile(int fd) : fd_(fd) {}
  ~OpenFile() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  int get() const {
    return fd_;
  }
  // Closes it now; returns close's result.
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

}  // namespace

nlohmann::json write_tensor_file(
    const std::string& dir,
    const std::string& name,
    const NamedTensors& tensors) {
  const auto path = (fs::path(dir) / name).string();
  for (const auto& [key, tensor] : tensors) {
    TORCH_CHECK_VALUE(
        is_saved_dtype(tensor.scalar_type()),
        "cannot save '",
        key,
        "' of dtype ",
        tensor.scalar_type());
  }
  crash_point("writing " + path);
  OpenFile file(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
  TORCH_CHECK(file.get() >= 0, "cannot write '", path, "': ", errno_text());
  nlohmann::json entries = nlohmann::json::object();
  Checksum checksum;
  int64_t offset = 0;
  auto put = [&](const void* data, size_t n) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    checksum.add(bytes, n);
    size_t done = 0;
    while (done < n) {
      const auto wrote = ::write(file.get(), bytes + done, n - done);
      if (wrote < 0 && errno == EINTR) {
        continue;
      }
      TORCH_CHECK(wrote > 0, "cannot write '", path, "': ", errno_text());
      done += static_cast<size_t>(wrote);
    }
    offset += static_cast<int64_t>(n);
  };
  const std::vector<uint8_t> zeros(kAlign, 0);
  for (const auto& [key, tensor] : tensors) {
    if (offset % kAlign != 0) {
      put(zeros.data(), static_cast<size_t>(kAlign - offset % kAlign));
    }
    const auto cpu = tensor.detach().to(torch::kCPU).contiguous();
    entries[key] = {
        {"offset", offset},
        {"dtype", c10::toString(cpu.scalar_type())},
        {"shape", cpu.sizes().vec()}};
    put(cpu.data_ptr(), cpu.nbytes());
  }
  TORCH_CHECK(
      ::fsync(file.get()) == 0,
      "cannot flush '",
      path,
      "' to disk: ",
      errno_text());
  TORCH_CHECK(file.close() == 0, "cannot write '", path, "': ", errno_text());
  return {
      {"bytes", offset}, {kChecksumKey, checksum.hex()}, {"tensors", entries}};
}

std::string begin_checkpoint(const std::string& root, int64_t step) {
  TORCH_CHECK_VALUE(
      step >= 0 && step <= kMaxCheckpointStep,
      "a checkpoint's step must be from 0 to ",
      kMaxCheckpointStep,
      ", but got ",
      step);
  std::error_code error;
  // Checkpoints saved inside one would never be loaded: loading `root`
  // reads `root` itself.
  if (fs::exists(fs::path(root) / kManifest, error)) {
    auto holder = fs::path(root).lexically_normal();
    if (!holder.has_filename()) {
      holder = holder.parent_path();  // "ckpt/step-5/"
    }
    holder = holder.parent_path();
    TORCH_CHECK_VALUE(
        false,
        "'",
        root,
        "' is a checkpoint itself (it holds ",
        kManifest,
        "); save into the directory that holds it ('",
        holder.empty() ? std::string(".") : holder.string(),
        "'), where loading takes the newest");
  }
  fs::create_directories(root, error);
  TORCH_CHECK(
      fs::is_directory(root),
      "cannot make the checkpoint directory '",
      root,
      "'",
      error ? ": " + error.message() : "");
  // Leftovers of writers that died (see Note [Writing a checkpoint]): an
  // unfinished checkpoint goes; an older one moved aside goes back in place
  // unless its successor got there.
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const auto name = entry.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".gone-", 0) == 0) {
      remove_tree(entry.path().string());
    } else if (name.rfind(".old-", 0) == 0) {
      const auto in_place = fs::path(root) / name.substr(5);
      if (fs::exists(in_place, error)) {
        (void)remove_checkpoint(root, entry.path());
      } else {
        fs::rename(entry.path(), in_place, error);
      }
    }
  }
  const auto tmp =
      (fs::path(root) / (".tmp-" + checkpoint_dir_name(step))).string();
  crash_point("making " + tmp);
  TORCH_CHECK(
      fs::create_directory(tmp, error),
      "cannot make '",
      tmp,
      "'",
      error ? ": " + error.message() : "");
  return tmp;
}

void commit_checkpoint(
    const std::string& root,
    const std::string& tmp,
    int64_t step,
    nlohmann::json manifest) {
  manifest["format"] = kCheckpointFormat;
  manifest["version"] = kCheckpointVersion;
  manifest[kManifestChecksumKey] = manifest_checksum(manifest);
  const auto path = (fs::path(tmp) / kManifest).string();
  crash_point("writing " + path);
  {
    std::ofstream out(path, std::ios::trunc);
    out << manifest.dump(1) << "\n";
    out.close();
    TORCH_CHECK(out, "cannot write '", path, "'");
  }
  crash_point("flushing " + path);
  sync_path(path);
  sync_path(tmp);
  const auto final_path = fs::path(root) / checkpoint_dir_name(step);
  const auto old = fs::path(root) / (".old-" + checkpoint_dir_name(step));
  std::error_code error;
  if (fs::exists(final_path, error)) {
    crash_point("moving the older " + final_path.string() + " aside");
    fs::rename(final_path, old, error);
    TORCH_CHECK(
        !error, "cannot move '", final_path.string(), "': ", error.message());
  }
  crash_point("renaming " + tmp);
  fs::rename(tmp, final_path, error);
  TORCH_CHECK(
      !error,
      "cannot rename '",
      tmp,
      "' to '",
      final_path.string(),
      "': ",
      error.message());
  sync_path(root);
  // (A reader may be reading it: Note [Removing a checkpoint beside
  // readers].)
  (void)remove_checkpoint(root, old);
  // Checkpoints of later steps are of a run that went on from an older one
  // and was given up (this one resumed from before them): they go, or a
  // resume would take them. Of the earlier ones the newest stays.
  // A later one that cannot go is an error: the save itself is done, but a
  // load would take the given-up run. An older one that cannot go is left,
  // with a warning (a load takes the newest, but the disk fills). Every
  // `step-<n>` counts, whole or not: one without its manifest (damaged, or
  // left by a removal that died) would stay forever, and a later one would
  // stop every load.
  bool kept_one = false;
  std::string later_left;
  std::string older_left;
  std::set<int64_t> whole;
  for (const auto& [n, path] : checkpoints_in(root)) {
    whole.insert(n);
  }
  std::map<int64_t, fs::path> all;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const auto n = step_of(entry.path().filename().string());
    if (n >= 0) {
      all.emplace(n, entry.path());
    }
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->first == step) {
      continue;
    }
    if (it->first < step && !kept_one && whole.count(it->first) > 0) {
      kept_one = true;
      continue;
    }
    const auto why = remove_checkpoint(root, it->second);
    if (it->first > step && !why.empty() && later_left.empty()) {
      later_left = why;
    }
    if (it->first < step && !why.empty() && older_left.empty()) {
      older_left = why;
    }
  }
  if (!older_left.empty()) {
    TORCH_WARN(
        "gpipe: the checkpoint of step ",
        step,
        " was written to '",
        final_path.string(),
        "', but an older checkpoint, which it replaces, could not be removed (",
        older_left,
        "); it stays in '",
        root,
        "' until a later save removes it");
  }
  TORCH_CHECK(
      later_left.empty(),
      "the checkpoint of step ",
      step,
      " was written to '",
      final_path.string(),
      "', but a checkpoint of a later step, of the run it replaces, could "
      "not be removed (",
      later_left,
      "): loading '",
      root,
      "' would take that one; remove it, or load '",
      final_path.string(),
      "' itself");
}

}  // namespace gpipe::detail
