#pragma once

// A store whose waits do not hold the process's store client, for groups
// made while the rank runs (the ordered channel's pair groups).
//
// Note [Waiting on the store while others use it]
// c10d's TCPStore client serves one operation at a time: a `get` of a key
// nobody has set yet holds its lock until the key comes, and every other
// store operation of the process (another pair's group being made, the
// failure listener's check) waits behind it. A pair's group is made when
// the pair first talks, and its other side may come much later (a reader
// of rank 0 made when it posts the receive of a loss that the last rank
// sends at the end of the step): with gets that hold the client, 4 ranks
// under 1F1B deadlocked, on Gloo pairs as on NCCL's. Here a wait polls
// `check` (which answers at once) and sleeps in between, backing off to
// 20 ms; set, add and the others go straight through. A wait also ends
// when `stop` says so (the channel was aborted or is closing), so that an
// abort does not wait out a group that will never be made.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace gpipe::dist::detail {

// (No member says `override`: clone() overrides Store's only in LibTorch
// versions that have it, and a class marks all its overrides or none.)
class PollingStore final : public c10d::Store {
 public:
  /// Waits through `inner`, for at most `timeout` (the store's timeout),
  /// unless `stop()` says to give up first (a c10::Error then).
  PollingStore(
      c10::intrusive_ptr<c10d::Store> inner,
      std::chrono::milliseconds timeout,
      std::function<bool()> stop);

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
  /// Another PollingStore over the same inner store (Store::clone of
  /// LibTorch 2.x: a copy safe to use from another thread).
  virtual c10::intrusive_ptr<c10d::Store> clone();

 private:
  c10::intrusive_ptr<c10d::Store> inner_;
  std::function<bool()> stop_;
};

}  // namespace gpipe::dist::detail
