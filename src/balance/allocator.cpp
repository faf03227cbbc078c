#include "balance/allocator.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace gpipe::detail {

namespace {

// Note [Counting CPU allocations]
// balance_by_size measures what a layer's forward allocates and keeps alive
// (its output and the tensors its graph saves for backward), on CPU, where
// LibTorch has no memory statistics. While profiling, LibTorch's CPU
// allocator is replaced by a wrapper that forwards every allocation to it
// and, for allocations of a thread inside a CountingWindow, adds the bytes to
// the window and takes them off when they are freed, whenever and on
// whichever thread that happens. Only the profiling thread counts, so other
// threads of the program neither disturb the numbers nor pay more than a
// thread-local test.
//
// A counted allocation keeps its data pointer as context (as the default
// allocator's do), looked up in a registry when freed, so that the "raw"
// interface works: oneDNN allocates through raw_allocate/raw_deallocate of
// the CPU allocator. Memory raw-allocated while counting may be freed after
// the wrapper is gone, by the wrapped allocator's raw deleter; its record
// then stays behind until the address comes back, and is dropped then
// without freeing anything.
//
// c10::SetAllocator only replaces an allocator of lower or equal priority,
// and nothing reports the current priority: the wrapper goes in at the
// lowest priority that takes, which is the current one, and the previous
// allocator goes back at that same priority. The wrapper lives for the rest
// of the process: tensors allocated through it may outlive the profiling,
// and a storage resized later allocates through the allocator it was made
// with.

thread_local LiveBytes* counting_window = nullptr;

class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& get() {
    static auto* allocator = new CountingCpuAllocator();
    return *allocator;
  }

  void set_base(c10::Allocator* base) {
    base_.store(base);
    base_raw_deleter_.store(base->raw_deleter());
  }

  // No `override` in this class: LibTorch before 2.3 declares allocate()
  // const and has no copy_data(), later versions declare allocate()
  // non-const and copy_data() pure. Both forms are defined, and each
  // overrides where the headers declare it (clang warns about `override` on
  // some members but not others).
  c10::DataPtr allocate(size_t n) const {
    return counted(n);
  }
  c10::DataPtr allocate(size_t n) {
    return counted(n);
  }
  void copy_data(void* dest, const void* src, size_t count) const {
    std::memcpy(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const {
    return base_raw_deleter_.load() != nullptr ? &release : nullptr;
  }

 private:
  struct Record {
    c10::DataPtr inner;
    size_t bytes = 0;
    LiveBytes live;
  };

  CountingCpuAllocator() = default;

  static std::mutex& registry_mutex() {
    static auto* mutex = new std::mutex();
    return *mutex;
  }
  // Counted allocations by data pointer. Guarded by registry_mutex().
  static std::unordered_map<void*, Record>& registry() {
    static auto* records = new std::unordered_map<void*, Record>();
    return *records;
  }

  c10::DataPtr counted(size_t n) const {
    c10::Allocator* base = base_.load();
    LiveBytes* window = counting_window;
    if (window == nullptr || n == 0) {
      return base->allocate(n);
    }
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    (*window)->fetch_add(static_cast<int64_t>(n));
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      auto& record = registry()[data];
      if (record.inner) {
        // A record left by memory freed behind our back (see Note
        // [Counting CPU allocations]): its memory is gone already.
        record.inner.release_context();
      }
      record = Record{std::move(inner), n, *window};
    }
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }

  static void release(void* data) {
    Record record;
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      auto it = registry().find(data);
      if (it != registry().end()) {
        record = std::move(it->second);
        registry().erase(it);
      }
    }
    if (!record.inner) {
      // Raw-allocated while not counting: the wrapped allocator's.
      if (auto deleter = base_raw_deleter_.load()) {
        deleter(data);
      }
      return;
    }
    record.live->fetch_sub(static_cast<int64_t>(record.bytes));
    // `record.inner` frees the memory as it goes.
  }

  inline static std::atomic<c10::Allocator*> base_{nullptr};
  inline static std::atomic<c10::DeleterFnPtr> base_raw_deleter_{nullptr};
};

}  // namespace

CountingAllocatorScope::CountingAllocatorScope() : lock_(mutex()) {
  auto* counting = &CountingCpuAllocator::get();
  previous_ = c10::GetAllocator(c10::DeviceType::CPU);
  TORCH_INTERNAL_ASSERT(previous_ != counting);
  counting->set_base(previous_);
  for (int priority = 0; priority <= 255; ++priority) {
    c10::SetAllocator(
        c10::DeviceType::CPU, counting, static_cast<uint8_t>(priority));
    if (c10::GetAllocator(c10::DeviceType::CPU) == counting) {
      priority_ = static_cast<uint8_t>(priority);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "could not install the counting allocator");
}

CountingAllocatorScope::~CountingAllocatorScope() {
  c10::SetAllocator(c10::DeviceType::CPU, previous_, priority_);
}

std::mutex& CountingAllocatorScope::mutex() {
  static std::mutex mutex;
  return mutex;
}

CountingWindow::CountingWindow()
    : live_(std::make_shared<std::atomic<int64_t>>(0)),
      previous_(counting_window) {
  counting_window = &live_;
}

CountingWindow::~CountingWindow() {
  counting_window = previous_;
}

}  // namespace gpipe::detail
