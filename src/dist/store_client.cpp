// See Note [Letting go of a store whose host ended] in store_client.h.

#include "dist/store_client.h"

#include <c10/util/Exception.h>

#include <utility>

namespace gpipe::dist::detail {

StoreClient::StoreClient(
    c10::intrusive_ptr<c10d::Store> inner, std::string host)
    : c10d::Store(inner->getTimeout()),
      inner_(std::move(inner)),
      host_(std::move(host)) {}

c10::intrusive_ptr<c10d::Store> StoreClient::inner() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(
      inner_,
      "gpipe::dist: the job's store at ",
      host_,
      " is gone (rank 0, which hosted it, ended or stopped answering)");
  return inner_;
}

bool StoreClient::let_go() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !inner_;
}

void StoreClient::set(
    const std::string& key, const std::vector<uint8_t>& value) {
  inner()->set(key, value);
}

std::vector<uint8_t> StoreClient::compareSet(
    const std::string& key,
    const std::vector<uint8_t>& expected,
    const std::vector<uint8_t>& desired) {
  return inner()->compareSet(key, expected, desired);
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  return inner()->get(key);
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  return inner()->add(key, value);
}

bool StoreClient::deleteKey(const std::string& key) {
  return inner()->deleteKey(key);
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  auto store = inner();
  try {
    return store->check(keys);
  } catch (...) {
    // A check answers at once while the host lives: it is gone. The last
    // reference to the TCPStore may be this one (or a call in flight on
    // another thread), whose destructor stops the client's thread.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inner_.reset();
    }
    store.reset();
    throw;
  }
}

int64_t StoreClient::getNumKeys() {
  return inner()->getNumKeys();
}

void StoreClient::wait(const std::vector<std::string>& keys) {
  inner()->wait(keys);
}

void StoreClient::wait(
    const std::vector<std::string>& keys,
    const std::chrono::milliseconds& timeout) {
  inner()->wait(keys, timeout);
}

void StoreClient::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  inner()->setTimeout(timeout);
}

c10::intrusive_ptr<c10d::Store> StoreClient::clone() {
  // One client serves every thread (TCPStore's operations take a lock).
  return c10::make_intrusive<StoreClient>(inner(), host_);
}

}  // namespace gpipe::dist::detail
