// gpipe's tagged messages over a backend without tags (see the Note), one
// channel per World. Used by the NCCL backend (src/dist/nccl.cpp), and
// tested over Gloo (tests/dist/ordered_channel_test.cpp).
//
// Note [Tags over an ordered backend]
// NCCL has no tags: it matches the sends and receives between two ranks in
// the order they are posted. gpipe posts a receive for exactly the message
// it needs next, and a rank may need micro-batch 3's gradient from a peer
// before it takes micro-batch 5's activation from the same peer. So:
// - every ordered pair of ranks that talks has an NCCL group of its own,
//   of two (the sender its rank 0): a posted receive never holds up a send
//   in the other direction or to another peer;
// - every message is a frame (its tag and length: two int64) followed by
//   its bytes, posted in order by one writer thread per peer;
// - a rank reads each peer's frames on a thread of its own, for as long as
//   a receive from that peer is posted and unmatched, and hands each
//   message to the receive posted on its tag, or keeps it until one is.
//   Since a peer sends only what this rank will receive, every frame read
//   is one that was sent; and no NCCL receive is posted while nothing is
//   expected (NCCL's watchdog would end an idle one).
// Each pair's group is made and used by its one writer (or reader) thread
// alone: c10d's NCCL group is not safe to call from several threads at once
// (with one group per direction shared by a rank's readers and writers, a
// 4-rank run corrupted the heap), and NCCL makes a pair's communicator at
// its first send and receive, where the send waits until the peer
// receives: on its own thread that wait holds up no lane and no other peer
// (a lane blocked there could starve the peer of what it needs before it
// asks this rank for anything). A pair's group is made when the pair first
// talks, so its other side may come much later: its waits on the store
// poll rather than hold the process's store client (Note [Waiting on the
// store while others use it] in polling_store.h; holding it deadlocked 4
// ranks under 1F1B), and end on an abort. The group of all the ranks
// serves the collectives only.
// NCCL's works say when they end (isCompleted), and readers and senders
// poll them, so that an abort or gpipe's timeout can stop the wait; Gloo's
// end only when waited for, so over Gloo (the tests) a reader blocks in the
// wait and an abort ends the work. A message's frame send is kept with its
// body's until both end (a Gloo send ends when its work goes).
// Messages are host bytes on both ends (gpipe packs them on the host); they
// travel through the rank's GPU. A send ends when the peer's GPU has the
// bytes; a receive when they are back in the posted host buffer.

#include "dist/ordered_channel.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "dist/ordered_channel_work.h"
#include "dist/polling_store.h"

namespace gpipe::dist::detail {

namespace {

using ordered::finished;
using ordered::RecvWork;
using ordered::SendWork;

// What this rank sends one peer, in order.
struct Outbox {
  struct Message {
    torch::Tensor bytes;
    int tag = 0;
    c10::intrusive_ptr<SendWork> work;
  };
  std::deque<Message> queue;
  std::thread writer;
  c10::intrusive_ptr<PairGroup>
      group;  // this rank and the peer, made by writer
};

// What one peer sends this rank: messages read ahead of their receive, and
// receives posted ahead of their message, by tag.
struct Inbox {
  std::map<int, std::deque<torch::Tensor>> arrived;
  std::map<int, std::deque<c10::intrusive_ptr<RecvWork>>> waiting;
  int64_t wanted = 0;  // receives waiting
  std::thread reader;
  std::string failed;  // why the reader ended, if it did on an error
  c10::intrusive_ptr<c10d::Work> posted;  // the reader's receive in flight
  c10::intrusive_ptr<PairGroup>
      group;  // the peer and this rank, made by reader
};

class OrderedChannel final : public Channel {
 public:
  OrderedChannel(
      c10::intrusive_ptr<c10d::Store> store,
      int64_t rank,
      int64_t size,
      c10::Device device,
      PairFactory make_pair,
      PairAbort abort_pair,
      bool poll)
      : store_(std::move(store)),
        rank_(rank),
        device_(device),
        make_pair_(std::move(make_pair)),
        abort_pair_(std::move(abort_pair)),
        poll_(poll),
        inboxes_(static_cast<size_t>(size)),
        outboxes_(static_cast<size_t>(size)) {}

  ~OrderedChannel() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& inbox : inboxes_) {
      if (inbox.reader.joinable()) {
        inbox.reader.join();
      }
    }
    for (auto& outbox : outboxes_) {
      if (outbox.writer.joinable()) {
        outbox.writer.join();
      }
    }
  }

  c10::intrusive_ptr<c10d::Work> send(
      torch::Tensor bytes, int64_t peer, int tag) override {
    auto work = c10::make_intrusive<SendWork>(poll_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) {
      work->posted({}, "the send was aborted");
      return work;
    }
    auto& outbox = outboxes_[static_cast<size_t>(peer)];
    outbox.queue.push_back({std::move(bytes), tag, work});
    if (!outbox.writer.joinable()) {
      outbox.writer = std::thread([this, peer] { write(peer); });
    }
    cv_.notify_all();
    return work;
  }

  c10::intrusive_ptr<c10d::Work> recv(
      torch::Tensor bytes, int64_t peer, int tag) override {
    auto work = c10::make_intrusive<RecvWork>(std::move(bytes), peer, tag);
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) {
      work->abort();
      return work;
    }
    auto& inbox = inboxes_[static_cast<size_t>(peer)];
    auto& arrived = inbox.arrived[tag];
    if (!arrived.empty()) {
      work->deliver(arrived.front());
      arrived.pop_front();
      return work;
    }
    if (!inbox.failed.empty()) {  // its reader has ended on an error
      work->fail(inbox.failed);
      return work;
    }
    inbox.waiting[tag].push_back(work);
    ++inbox.wanted;
    if (!inbox.reader.joinable()) {
      inbox.reader = std::thread([this, peer] { read(peer); });
    }
    cv_.notify_all();
    return work;
  }

  void abort() override {
    std::vector<c10::intrusive_ptr<RecvWork>> waiting;
    std::vector<c10::intrusive_ptr<SendWork>> unsent;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) {
        return;
      }
      aborted_ = true;
      for (auto& inbox : inboxes_) {
        take_waiting(inbox, waiting);
      }
      for (auto& outbox : outboxes_) {
        for (auto& message : outbox.queue) {
          unsent.push_back(std::move(message.work));
        }
        outbox.queue.clear();
      }
    }
    cv_.notify_all();
    for (auto& work : waiting) {
      work->abort();
    }
    for (auto& work : unsent) {
      work->posted({}, "the send was aborted");
    }
    // Ends the transfers the readers and writers may have posted.
    std::vector<c10::intrusive_ptr<PairGroup>> groups;
    std::vector<c10::intrusive_ptr<c10d::Work>> posted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& inbox : inboxes_) {
        if (inbox.group) {
          groups.push_back(inbox.group);
        }
        if (inbox.posted) {
          posted.push_back(inbox.posted);
        }
      }
      for (auto& outbox : outboxes_) {
        if (outbox.group) {
          groups.push_back(outbox.group);
        }
      }
    }
    for (auto& work : posted) {
      try {
        work->abort();
      } catch (...) {
        // (The group's abort below ends it.)
      }
    }
    for (auto& group : groups) {
      try {
        abort_pair_(*group);
      } catch (...) {
        // Already broken: nothing is left to end.
      }
    }
  }

 private:
  // The writer of this rank's messages to `peer`: it posts them in order
  // (see the Note). NCCL makes a pair's communicator at the pair's first
  // send and receive, and the send waits there until the peer receives;
  // on a thread of its own that wait holds up no other peer and no lane.
  void write(int64_t peer) {
    c10::DeviceGuard guard(device_);
    auto& outbox = outboxes_[static_cast<size_t>(peer)];
    c10::intrusive_ptr<PairGroup> group;
    bool broken = false;
    std::string broken_why;
    while (true) {
      Outbox::Message message;
      bool head_posted = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] {
          return stopping_ || aborted_ || !outbox.queue.empty();
        });
        if (stopping_ || aborted_) {
          return;
        }
        message = std::move(outbox.queue.front());
        outbox.queue.pop_front();
      }
      try {
        if (!group) {
          group = pair_group(rank_, peer);
          std::lock_guard<std::mutex> lock(mutex_);
          outbox.group = group;
          if (aborted_ || stopping_) {  // made while abort() collected them
            message.work->posted({}, "the send was aborted");
            return;
          }
        }
        if (broken) {
          message.work->posted({}, broken_why);
          continue;
        }
        auto frame = torch::empty({2}, torch::kLong);
        frame.data_ptr<int64_t>()[0] = message.tag;
        frame.data_ptr<int64_t>()[1] = message.bytes.numel();
        std::vector<at::Tensor> head{frame.to(device_)};
        auto head_sent = group->send(head, 1, 0);
        head_posted = true;
        if (message.bytes.numel() == 0) {  // no body (the reader expects none)
          head.clear();
          message.work->posted(
              std::move(head_sent), {}, {}, {std::move(frame)});
          continue;
        }
        std::vector<at::Tensor> body{message.bytes.to(device_)};
        auto body_sent = group->send(body, 1, 0);
        head.clear();
        body.clear();
        message.work->posted(
            std::move(body_sent),
            {},
            std::move(head_sent),
            {std::move(frame), std::move(message.bytes)});
      } catch (const std::exception&) {
        const auto why = message_of(std::current_exception());
        message.work->posted({}, why);
        if (head_posted) {
          // A frame without its bytes: the peer would misread every later
          // frame, so no later message goes.
          broken = true;
          broken_why = "an earlier message to this peer failed: " + why;
        }
      }
    }
  }

  // The reader of `peer`'s messages (see the Note).
  void read(int64_t peer) {
    c10::DeviceGuard guard(device_);
    auto& inbox = inboxes_[static_cast<size_t>(peer)];
    c10::intrusive_ptr<PairGroup> group;
    auto stop = [this] {
      std::lock_guard<std::mutex> lock(mutex_);
      return stopping_ || aborted_;
    };
    auto receive = [&](int64_t n, torch::ScalarType dtype) {
      auto on_device =
          torch::empty({n}, torch::TensorOptions(dtype).device(device_));
      std::vector<at::Tensor> tensors{on_device};
      auto work = group->recv(tensors, 0, 0);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        inbox.posted = work;  // for abort()
      }
      bool ended = true;
      if (poll_) {
        ended = finished(work, stop);
      } else {
        try {
          work->wait();
        } catch (...) {
          if (!stop()) {
            throw;
          }
          ended = false;  // aborted
        }
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        inbox.posted.reset();
      }
      if (!ended) {
        return torch::Tensor();
      }
      if (poll_) {
        work->wait();  // rethrows NCCL's error; orders this stream after it
      }
      return on_device.cpu();
    };
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(
            lock, [&] { return stopping_ || aborted_ || inbox.wanted > 0; });
        if (stopping_ || aborted_) {
          return;
        }
      }
      torch::Tensor body;
      int tag = 0;
      try {
        if (!group) {
          group = pair_group(peer, rank_);
          std::lock_guard<std::mutex> lock(mutex_);
          inbox.group = group;
          if (aborted_ || stopping_) {  // made while abort() collected them
            return;
          }
        }
        auto frame = receive(2, torch::kLong);
        if (!frame.defined()) {
          return;
        }
        tag = static_cast<int>(frame[0].item<int64_t>());
        const auto n = frame[1].item<int64_t>();
        body =
            n > 0 ? receive(n, torch::kByte) : torch::empty({0}, torch::kByte);
        if (!body.defined()) {
          return;
        }
      } catch (const std::exception&) {
        fail_inbox(inbox, message_of(std::current_exception()));
        return;
      }
      c10::intrusive_ptr<RecvWork> work;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto& waiting = inbox.waiting[tag];
        if (waiting.empty()) {
          inbox.arrived[tag].push_back(std::move(body));
          continue;
        }
        work = std::move(waiting.front());
        waiting.pop_front();
        --inbox.wanted;
      }
      work->deliver(body);
    }
  }

  // Moves `inbox`'s waiting receives into `out` (mutex_ held).
  static void take_waiting(
      Inbox& inbox, std::vector<c10::intrusive_ptr<RecvWork>>& out) {
    for (auto& entry : inbox.waiting) {
      for (auto& work : entry.second) {
        out.push_back(std::move(work));
      }
    }
    inbox.waiting.clear();
    inbox.wanted = 0;
  }

  // NCCL failed under `inbox`'s reader: its receives fail with that.
  void fail_inbox(Inbox& inbox, const std::string& why) {
    std::vector<c10::intrusive_ptr<RecvWork>> waiting;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inbox.failed = why.empty() ? std::string("NCCL failed") : why;
      take_waiting(inbox, waiting);
    }
    for (auto& work : waiting) {
      work->fail(why);
    }
  }

  // The group of two that carries `from`'s messages to `to` (rank 0 the
  // sender, 1 the receiver), made by the one thread that uses it.
  // Its waits on the store poll, so that they hold up no other use of the
  // store, and end on an abort (Note [Waiting on the store while others use
  // it] in polling_store.h).
  c10::intrusive_ptr<PairGroup> pair_group(int64_t from, int64_t to) {
    auto store = c10::make_intrusive<PollingStore>(
        c10::make_intrusive<c10d::PrefixStore>(
            "pair/" + std::to_string(from) + "-" + std::to_string(to) + "/",
            store_),
        [this] {
          std::lock_guard<std::mutex> lock(mutex_);
          return stopping_ || aborted_;
        });
    return make_pair_(store, from == rank_ ? 0 : 1);
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const int64_t rank_;
  const c10::Device device_;
  const PairFactory make_pair_;
  const PairAbort abort_pair_;
  const bool poll_;
  std::mutex mutex_;  // guards the boxes and the flags
  std::condition_variable cv_;
  std::vector<Inbox> inboxes_;
  std::vector<Outbox> outboxes_;
  bool stopping_ = false;
  bool aborted_ = false;
};

}  // namespace

std::shared_ptr<Channel> ordered_channel(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    c10::Device device,
    PairFactory make_pair,
    PairAbort abort_pair,
    bool poll) {
  return std::make_shared<OrderedChannel>(
      std::move(store),
      rank,
      size,
      device,
      std::move(make_pair),
      std::move(abort_pair),
      poll);
}

}  // namespace gpipe::dist::detail
