#pragma once

// A c10d Store that passes every operation on to another store: the base of
// gpipe's wrappers over the job's store (StoreClient, PollingStore), which
// change one or two operations each and forward the rest.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace gpipe::dist::detail {

// (No member says `override`: clone() overrides Store's only in LibTorch
// versions that have it, and a class marks all its overrides or none.)
class ForwardingStore : public c10d::Store {
 public:
  virtual void set(const std::string& key, const std::vector<uint8_t>& value);
  virtual std::vector<uint8_t> compareSet(
      const std::string& key,
      const std::vector<uint8_t>& expected,
      const std::vector<uint8_t>& desired);
  virtual std::vector<uint8_t> get(const std::string& key);
  virtual int64_t add(const std::string& key, int64_t value);
  virtual bool deleteKey(const std::string& key);
  virtual bool check(const std::vector<std::string>& keys);
  virtual int64_t getNumKeys();
  virtual void wait(const std::vector<std::string>& keys);
  virtual void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout);

 protected:
  explicit ForwardingStore(std::chrono::milliseconds timeout);

  /// The store every operation goes to (it may throw: StoreClient's when
  /// it let go of its store).
  virtual c10::intrusive_ptr<c10d::Store> target() const = 0;
};

}  // namespace gpipe::dist::detail
