// What a rank has long been waiting for, said in the job's store for the
// ranks that time out waiting for it (Note [What a rank waits for]).

#include <c10/util/irange.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "dist/connection.h"

namespace gpipe::dist::detail {

namespace {

// The store's key under which a rank says what it has long waited for,
// and its text.
constexpr const char* kWaitingKey = "waiting/";

std::vector<uint8_t> waiting_bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

}  // namespace

// Note [What a rank waits for]
// A rank that times out waiting for another (in a collective, Note [Who a
// collective waits for]) names it; but that rank may be alive, itself
// waiting for a third that stopped: rank 0 of a 2 x 2 mesh waits for rank
// 2 in their replicas' all-reduce while rank 2 waits for a gradient from
// rank 3, which stalled. So that rank 0 says so, the listener of a rank
// whose receive has waited a quarter of the timeout (2 s at most) writes
// whom and what it waits for under the rank's key of the job's store (a
// write when the wait has been long, another when it is over; none for a
// wait that ends sooner). A failure leaves it there, for the ranks that
// read it after their own timeout. A rank that names another as absent reads
// that key and adds what it says. A rank's Worlds share the key: the last
// to write wins, and takes back only what it wrote itself.

void Connection::note_long_waits() {
  const auto now = std::chrono::steady_clock::now();
  const auto after = std::min<std::chrono::steady_clock::duration>(
      timeout / 4, std::chrono::milliseconds(2000));
  std::string note;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) {
      return;  // the note stays for the ranks that read it
    }
    for (const auto& entry : waits_) {
      const auto& wait = entry.second;
      if (now - wait.since < after) {
        continue;
      }
      if (wait.peer >= 0) {
        note = "for " + *wait.what + " from " + rank_name(wait.peer);
      } else {
        note = "in the " + *wait.what + " (ranks ";
        for (const auto r : c10::irange(size)) {
          note += (r == 0 ? "" : ", ") + std::to_string(global_rank(r));
        }
        note += ")";
      }
      break;
    }
  }
  if (note == noted_) {
    return;
  }
  const auto key = kWaitingKey + std::to_string(global_rank(rank));
  try {
    if (noted_.empty()) {
      job_store->set(key, waiting_bytes(note));
    } else {
      job_store->compareSet(key, waiting_bytes(noted_), waiting_bytes(note));
    }
  } catch (...) {
    // The store is gone: nobody asks.
  }
  noted_ = note;
}

std::string Connection::peer_waits(int64_t peer) const {
  const auto note = waiting_note(global_rank(peer));
  return note.empty()
             ? note
             : " (" + rank_name(peer) + " was itself waiting " + note + ")";
}

std::string Connection::waiting_note(int64_t global_rank) const {
  try {
    const auto key = kWaitingKey + std::to_string(global_rank);
    if (!job_store->check({key})) {
      return "";
    }
    const auto value = job_store->get(key);
    return {value.begin(), value.end()};
  } catch (...) {
    return "";
  }
}

Connection::Listed::Listed(
    Connection& connection, const c10d::Work* work, Wait wait)
    : connection_(connection), work_(work) {
  std::lock_guard<std::mutex> lock(connection_.mutex_);
  connection_.waits_[work_] = wait;
}

Connection::Listed::~Listed() {
  std::lock_guard<std::mutex> lock(connection_.mutex_);
  connection_.waits_.erase(work_);
}

void Connection::take_back_note() {
  if (noted_.empty() || failure_) {
    return;
  }
  try {
    job_store->compareSet(
        kWaitingKey + std::to_string(global_rank(rank)),
        waiting_bytes(noted_),
        {});
  } catch (...) {
    // The store is gone: nobody asks.
  }
}

}  // namespace gpipe::dist::detail
