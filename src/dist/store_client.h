#pragma once

// The process's client of the job's store (rank 0's TCPStore), which it
// lets go of once the store's host has ended.
//
// Note [Letting go of a store whose host ended]
// LibTorch 1.13's TCPStore client runs a thread for watchKey's callbacks.
// Once the store's host has closed the connection (rank 0 ended), that
// thread polls the socket, peeks 0 bytes and polls again, on a whole core,
// until the TCPStore is destroyed: a rank that outlived rank 0 by ten
// seconds (saving, evaluating, or only ending later) spent nine of them
// spinning. Every holder of the store (the Worlds' PrefixStores, the
// process groups) holds this wrapper instead, and when a `check` fails
// (the failure listener makes one every 20 ms for as long as the World
// lives: Connection::listen) the host is gone, and the wrapper drops the
// TCPStore, whose destructor stops that thread. Later calls throw, as calls
// to a store whose host ended would.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "dist/forwarding_store.h"

namespace gpipe::dist::detail {

class StoreClient final : public ForwardingStore {
 public:
  /// `host`: where the store is, for messages ("127.0.0.1:29500").
  StoreClient(c10::intrusive_ptr<c10d::Store> inner, std::string host);

  /// Lets go of the store when it fails (see the Note).
  virtual bool check(const std::vector<std::string>& keys);
  virtual void setTimeout(const std::chrono::milliseconds& timeout);
  /// Another wrapper over the same store (Store::clone of LibTorch 2.x: a
  /// copy safe to use from another thread).
  virtual c10::intrusive_ptr<c10d::Store> clone();

  /// Whether the store was let go of.
  bool let_go() const;

 private:
  /// The store, or a c10::Error when it was let go of.
  virtual c10::intrusive_ptr<c10d::Store> target() const;

  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Store> inner_;  // guarded by mutex_
  const std::string host_;
};

/// Rank 0's own store (the TCPStore that hosts the job's keys), as every
/// holder in this process holds it: when the last holder lets go,
/// `on_close` is given the TCPStore, whose server serves the other ranks
/// for as long as it is kept. Note [Knowing which ports this process hosts]
/// in dist/world.cpp.
class HostedStore final : public ForwardingStore {
 public:
  using OnClose = std::function<void(c10::intrusive_ptr<c10d::Store>)>;
  HostedStore(c10::intrusive_ptr<c10d::Store> inner, OnClose on_close);
  ~HostedStore();
  HostedStore(const HostedStore&) = delete;
  HostedStore& operator=(const HostedStore&) = delete;

  virtual void setTimeout(const std::chrono::milliseconds& timeout);
  /// This store itself (TCPStore's operations take a lock: one serves
  /// every thread).
  virtual c10::intrusive_ptr<c10d::Store> clone();

 private:
  virtual c10::intrusive_ptr<c10d::Store> target() const;

  c10::intrusive_ptr<c10d::Store> inner_;
  OnClose on_close_;
};

}  // namespace gpipe::dist::detail
