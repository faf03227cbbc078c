// See Note [Letting go of a store whose host ended] in store_client.h.

#include "dist/store_client.h"

#include <c10/util/Exception.h>

#include <utility>

#include "text.h"

namespace gpipe::dist::detail {

StoreClient::StoreClient(
    c10::intrusive_ptr<c10d::Store> inner, std::string host)
    : ForwardingStore(inner->getTimeout()),
      inner_(std::move(inner)),
      host_(std::move(host)) {}

c10::intrusive_ptr<c10d::Store> StoreClient::target() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!inner_) {
    // A failure of the job, not of gpipe's code: no LibTorch backtrace
    // (Note [Errors without LibTorch's backtrace] in text.h).
    gpipe::detail::fail_without_backtrace(c10::str(
        "gpipe::dist: lost the job's store at ",
        host_,
        ": it is gone (rank 0, which hosted it, ended or stopped answering)"));
  }
  return inner_;
}

bool StoreClient::let_go() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !inner_;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  auto store = target();
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

void StoreClient::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  target()->setTimeout(timeout);
}

c10::intrusive_ptr<c10d::Store> StoreClient::clone() {
  // One client serves every thread (TCPStore's operations take a lock).
  return c10::make_intrusive<StoreClient>(target(), host_);
}

HostedStore::HostedStore(
    c10::intrusive_ptr<c10d::Store> inner, OnClose on_close)
    : ForwardingStore(inner->getTimeout()),
      inner_(std::move(inner)),
      on_close_(std::move(on_close)) {}

HostedStore::~HostedStore() {
  if (on_close_) {
    on_close_(std::move(inner_));
  }
}

void HostedStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  inner_->setTimeout(timeout);
}

c10::intrusive_ptr<c10d::Store> HostedStore::clone() {
  return c10::intrusive_ptr<c10d::Store>::reclaim_copy(this);
}

c10::intrusive_ptr<c10d::Store> HostedStore::target() const {
  return inner_;
}

}  // namespace gpipe::dist::detail
