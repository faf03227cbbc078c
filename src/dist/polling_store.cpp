// See Note [Waiting on the store while others use it] in polling_store.h.

#include "dist/polling_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>
#include <utility>

namespace gpipe::dist::detail {

PollingStore::PollingStore(
    c10::intrusive_ptr<c10d::Store> inner, std::function<bool()> stop)
    : ForwardingStore(kNoTimeout),
      inner_(std::move(inner)),
      stop_(std::move(stop)) {}

c10::intrusive_ptr<c10d::Store> PollingStore::target() const {
  return inner_;
}

std::vector<uint8_t> PollingStore::get(const std::string& key) {
  wait({key});
  return inner_->get(key);  // there now: answered at once
}

void PollingStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void PollingStore::wait(
    const std::vector<std::string>& keys,
    const std::chrono::milliseconds& /*timeout*/) {
  auto pause = std::chrono::microseconds(200);
  while (!inner_->check(keys)) {
    TORCH_CHECK(
        !stop_(),
        "gpipe::dist: stopped waiting for the other rank of a group (the "
        "channel was aborted or closed)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

c10::intrusive_ptr<c10d::Store> PollingStore::clone() {
  return c10::make_intrusive<PollingStore>(inner_, stop_);
}

}  // namespace gpipe::dist::detail
