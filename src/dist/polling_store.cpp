// See Note [Waiting on the store while others use it] in polling_store.h.

#include "dist/polling_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>
#include <utility>

namespace gpipe::dist::detail {

PollingStore::PollingStore(
    c10::intrusive_ptr<c10d::Store> inner, std::function<bool()> stop)
    : c10d::Store(kNoTimeout),
      inner_(std::move(inner)),
      stop_(std::move(stop)) {}

void PollingStore::set(
    const std::string& key, const std::vector<uint8_t>& value) {
  inner_->set(key, value);
}

std::vector<uint8_t> PollingStore::compareSet(
    const std::string& key,
    const std::vector<uint8_t>& expected,
    const std::vector<uint8_t>& desired) {
  return inner_->compareSet(key, expected, desired);
}

std::vector<uint8_t> PollingStore::get(const std::string& key) {
  wait({key});
  return inner_->get(key);  // there now: answered at once
}

int64_t PollingStore::add(const std::string& key, int64_t value) {
  return inner_->add(key, value);
}

bool PollingStore::deleteKey(const std::string& key) {
  return inner_->deleteKey(key);
}

bool PollingStore::check(const std::vector<std::string>& keys) {
  return inner_->check(keys);
}

int64_t PollingStore::getNumKeys() {
  return inner_->getNumKeys();
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
