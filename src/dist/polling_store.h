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
// under 1F1B deadlocked on Gloo pairs (NCCL's pairs wait the same way, for
// the NCCL id of the pair, and 4 ranks under 1F1B hung there too). Here a
// wait polls `check` (which answers at once) and sleeps in between, backing
// off to 20 ms; set, add and the others go straight through. A wait has no
// deadline of its own, whatever timeout the group asks for: it ends when
// `stop` says so (the channel was aborted or is closing). gpipe's timeout
// counts from when a lane waits for a message, not from when the receive
// was posted: the last rank's loss, whose receive rank 0 posts when the
// step begins, may come a long step later, and the pair's group with it.
// A lane that waits too long fails the connection, which aborts the
// channel and so ends the group's wait.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dist/forwarding_store.h"

namespace gpipe::dist::detail {

class PollingStore final : public ForwardingStore {
 public:
  /// Waits through `inner` until the keys come, or until `stop()` says to
  /// give up (a c10::Error then).
  PollingStore(
      c10::intrusive_ptr<c10d::Store> inner, std::function<bool()> stop);

  virtual std::vector<uint8_t> get(const std::string& key);
  virtual void wait(const std::vector<std::string>& keys);
  /// (`timeout` is not a deadline here: see the Note.)
  virtual void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout);
  /// Another PollingStore over the same inner store (Store::clone of
  /// LibTorch 2.x: a copy safe to use from another thread).
  virtual c10::intrusive_ptr<c10d::Store> clone();

 private:
  virtual c10::intrusive_ptr<c10d::Store> target() const;

  c10::intrusive_ptr<c10d::Store> inner_;
  std::function<bool()> stop_;
};

}  // namespace gpipe::dist::detail
