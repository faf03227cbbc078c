#include "dist/forwarding_store.h"

namespace gpipe::dist::detail {

ForwardingStore::ForwardingStore(std::chrono::milliseconds timeout)
    : c10d::Store(timeout) {}

void ForwardingStore::set(
    const std::string& key, const std::vector<uint8_t>& value) {
  target()->set(key, value);
}

std::vector<uint8_t> ForwardingStore::compareSet(
    const std::string& key,
    const std::vector<uint8_t>& expected,
    const std::vector<uint8_t>& desired) {
  return target()->compareSet(key, expected, desired);
}

std::vector<uint8_t> ForwardingStore::get(const std::string& key) {
  return target()->get(key);
}

int64_t ForwardingStore::add(const std::string& key, int64_t value) {
  return target()->add(key, value);
}

bool ForwardingStore::deleteKey(const std::string& key) {
  return target()->deleteKey(key);
}

bool ForwardingStore::check(const std::vector<std::string>& keys) {
  return target()->check(keys);
}

int64_t ForwardingStore::getNumKeys() {
  return target()->getNumKeys();
}

void ForwardingStore::wait(const std::vector<std::string>& keys) {
  target()->wait(keys);
}

void ForwardingStore::wait(
    const std::vector<std::string>& keys,
    const std::chrono::milliseconds& timeout) {
  target()->wait(keys, timeout);
}

}  // namespace gpipe::dist::detail
