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
#include <cstdint>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace gpipe::dist::detail {

// (No member says `override`: clone() overrides Store's only in LibTorch
// versions that have it, and a class marks all its overrides or none.)
class StoreClient final : public c10d::Store {
 public:
  /// `host`: where the store is, for messages ("127.0.0.1:29500").
  StoreClient(c10::intrusive_ptr<c10d::Store> inner, std::string host);

  virtual void set(const std::string& key, const std::vector<uint8_t>& value);
  virtual std::vector<uint8_t> compareSet(
      const std::string& key,
      const std::vector<uint8_t>& expected,
      const std::vector<uint8_t>& desired);
  virtual std::vector<uint8_t> get(const std::string& key);
  virtual int64_t add(const std::string& key, int64_t value);
  virtual bool deleteKey(const std::string& key);
  /// Lets go of the store when it fails (see the Note).
  virtual bool check(const std::vector<std::string>& keys);
  virtual int64_t getNumKeys();
  virtual void wait(const std::vector<std::string>& keys);
  virtual void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout);
  virtual void setTimeout(const std::chrono::milliseconds& timeout);
  /// Another wrapper over the same store (Store::clone of LibTorch 2.x: a
  /// copy safe to use from another thread).
  virtual c10::intrusive_ptr<c10d::Store> clone();

  /// Whether the store was let go of.
  bool let_go() const;

 private:
  /// The store, or a c10::Error when it was let go of.
  c10::intrusive_ptr<c10d::Store> inner() const;

  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Store> inner_;  // guarded by mutex_
  const std::string host_;
};

}  // namespace gpipe::dist::detail
