#pragma once

// The connection of one process to the others: the c10d store and group,
// the wire format of gpipe's messages, and the state every stage of the
// process shares (failure, control listener, agreed layouts).
//
// Note [Messages between ranks]
// Every message travels as one c10d send of bytes on a tag that names what it
// carries (kind, micro-batch, boundary or skip), so that a receiver posts its
// receive for exactly the message it needs and nothing has to be sorted out
// on arrival. A message starts with a header (magic, pass, kind, micro-batch,
// index, the layout's length and the payload's size) that the receiver
// checks: a rank that runs another pass, another model or another program
// ends with an error naming both sides instead of a hang or garbage.
//
// A c10d receive needs its size in advance. The first message on a tag is
// therefore a bare header, followed by a second message with the layout
// (per tensor: dtype, requires_grad, shape) and the payload. Both sides then
// remember that layout for the tag, and later messages with the same layout
// (every step of a training run) are one message: header and payload. When
// the layout changes (a smaller last batch), the sender sends the agreed
// size with a "relayout" header, then layout and payload as in the first
// exchange. One message per transfer is what keeps gpipe's overhead close
// to a bare c10d send (bench: `gpipe-bench --only dist`): a separate header
// message doubled it.
//
// Note [Failure notices]
// Failures travel on a control plane apart from the data channel: the
// rank whose pass fails first writes its message under a key of the
// World's store, and a listener thread of each process polls that key
// (every 20 ms) and, when it appears, aborts the receives and sends in
// progress there, which fail with that message. The data channel needs no
// any-source receive for this (NCCL has none), and a notice is out as
// soon as the store has taken it, even if the failing process exits next.
// A dead rank closes its sockets, so receives from it fail at once; a rank
// that stops answering is given up on after the timeout. After a failure
// the connection is closed for good: c10d cannot take back a posted
// receive, so the group is left alone (never reused, never destroyed) and
// later passes are refused.

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

#include "dist/backend.h"
#include "dist/wire.h"

namespace c10d {
class ProcessGroup;
class Store;
struct ReduceOp;
}  // namespace c10d

namespace gpipe::dist::detail {

/// Keeps a c10d object that Gloo may still use after a failure (a posted
/// receive, a send nobody takes, the group that holds them) for the life of
/// the process, reachable, so that neither its destructor nor
/// LeakSanitizer trips over it.
void keep_forever(c10::intrusive_ptr<c10::intrusive_ptr_target> object);

/// A c10d receive of bytes, posted and not yet waited for.
struct PostedBytes {
  c10::intrusive_ptr<c10d::Work> work;  // null when not posted
  torch::Tensor buffer;
  std::string refused;  // why c10d refused to post it
  bool failed = false;  // the connection had failed already
};

/// A message's receive, posted before the message is needed (a plan's
/// listed receive): its first part, of the size the agreed layout gives.
struct PostedReceive {
  int64_t peer = 0;
  int64_t pass = 0;
  MessageId id;
  std::optional<std::vector<int64_t>> agreed;
  PostedBytes head;
};

/// `failure` with the note that the connection is closed for good, once.
std::string with_closing_note(const std::string& failure);

struct Connection : std::enable_shared_from_this<Connection> {
  Connection(
      c10::intrusive_ptr<c10d::Store> store,
      Groups groups,
      int64_t rank,
      int64_t size,
      int64_t local_rank,
      int64_t local_size,
      std::chrono::milliseconds timeout,
      GroupFactory make_group,
      c10::intrusive_ptr<c10d::Store> job_store = {},
      std::vector<int64_t> global_ranks = {});
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  /// Sends `message` to `peer` for pass `pass`, without waiting; the send
  /// is added to `pending` (wait with wait_sends).
  void send(
      int64_t peer,
      int64_t pass,
      const MessageId& id,
      const Message& message,
      std::vector<c10::intrusive_ptr<c10d::Work>>& pending);
  /// Receives the message `id` of pass `pass` from `peer`. Throws the
  /// failure if the connection fails first, and a c10::Error naming both
  /// sides if what arrives is not what was expected.
  Message recv(int64_t peer, int64_t pass, const MessageId& id);
  /// recv in two halves: post the receive now (it never throws; a failure
  /// shows when it is completed), wait for it later. A posted receive is
  /// completed, or given up with `abandon` (the pass failed).
  PostedReceive post_recv(int64_t peer, int64_t pass, const MessageId& id);
  Message complete_recv(PostedReceive posted);
  /// Keeps a posted receive's work and buffer for good: c10d may still
  /// write into it.
  static void abandon(PostedReceive& posted);
  /// Waits for sends to complete (the data is on its way).
  void wait_sends(std::vector<c10::intrusive_ptr<c10d::Work>>& pending);
  /// Waits for a collective of this connection's group, at most the
  /// timeout: throws the connection's failure if it fails first (another
  /// rank's notice), and a c10::Error naming `what` and this rank if the
  /// collective fails or times out.
  void wait_collective(
      const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  /// Runs a collective of this connection's group on `tensors`, staged on
  /// the group's device where they are elsewhere (a CPU tensor on NCCL),
  /// and waits for it as wait_collective does; the staged results are
  /// copied back.
  void run_collective(
      std::vector<torch::Tensor>& tensors,
      const std::function<
          c10::intrusive_ptr<c10d::Work>(std::vector<torch::Tensor>&)>& start,
      const std::string& what);
  /// Throws the failure if there is one, else reduces `tensors` in place
  /// over the group with `op`, through run_collective.
  void all_reduce(
      std::vector<torch::Tensor>& tensors,
      const c10d::ReduceOp& op,
      const std::string& what);

  /// Marks the connection failed with `message` (the first failure wins),
  /// tells the other ranks, and aborts every receive and send in progress
  /// here.
  void fail(const std::string& message);
  /// Fails the connection because of `error`, met on this rank: another
  /// process's failure (a RelayedFailure) is passed on as it came, any other
  /// error as this rank's ("rank 3: ...").
  void fail_with(const std::exception_ptr& error);
  /// Runs a World's collective (`run`); if it fails or times out, the
  /// connection fails with that error, and it is thrown: the ranks may be
  /// out of step (Gloo closes its pairs after a timeout), so the World is
  /// closed, later collectives say why, and every rank hears it.
  void closing_on_failure(const std::function<void()>& run);
  /// After a c10d error: a rank that failed tells the others before its
  /// connections close, so give its notice a moment (half a second) to
  /// arrive; then it, not the lost connection, is what this rank reports.
  void await_failure_notice();
  /// "" while the job's store answers; once this rank found it gone (its
  /// host ended: rank 0, or torchrun's agent), a clause that says so, for
  /// the message of a lost connection, whose peer may only have closed it
  /// after losing rank 0.
  std::string store_gone_note() const;
  /// The failure, if any.
  std::optional<std::string> failure() const;
  /// Throws the failure as a c10::Error if there is one.
  void check() const;

  /// The rank of this World's rank `r` in the job (its root World): what
  /// messages name, so that a rank of a split World (a replica's pipeline,
  /// a stage's replicas) is the one the launcher and its logs know.
  int64_t global_rank(int64_t r) const {
    return global_ranks.empty() ? r : global_ranks[static_cast<size_t>(r)];
  }
  /// "rank 3": this World's rank `r`, by its rank in the job.
  std::string rank_name(int64_t r) const {
    return "rank " + std::to_string(global_rank(r));
  }
  // "rank 1, rank 2 and rank 3".
  std::string rank_names(const std::vector<int64_t>& ranks) const;

  /// A number for the next PipelineStage, the same on every rank when they
  /// build their stages in the same order.
  int64_t next_stage_id() {
    return stage_ids_++;
  }
  /// A number for the next World::split, the same on every rank (splits
  /// are collective).
  int64_t next_split_id() {
    return split_ids_++;
  }

  c10::intrusive_ptr<c10d::Store> store;
  /// The store of the job's own World (this one's, unless it was split from
  /// another): where a rank says what it waits for, to every World's ranks
  /// (Note [What a rank waits for]).
  const c10::intrusive_ptr<c10d::Store> job_store;
  // What the backend made (Note [Backends] in dist/backend.h); left alone
  // (leaked) after a failure: see the Note.
  Groups groups;
  const c10::intrusive_ptr<c10d::ProcessGroup>& group = groups.group;
  const int64_t rank;
  const int64_t size;
  const int64_t local_rank;
  const int64_t local_size;
  const std::chrono::milliseconds timeout;
  /// Makes this connection's sub-groups (World::split), as its own was made.
  const GroupFactory make_group;
  /// Each rank's rank in the job, for a split World; empty for the job's
  /// own (the same numbers). Set when it is made.
  std::vector<int64_t> global_ranks;
  /// Note [What a rank waits for]: what rank `global_rank` of the job said
  /// it has long been waiting for ("for ... from rank 3", "in the ..."),
  /// or "".
  std::string waiting_note(int64_t global_rank) const;
  /// Held by World::all_reduce, broadcast, barrier and split (Note [A
  /// World's collectives from several threads] in world_collectives.cpp).
  std::mutex world_collectives_mutex;
  /// Held by a pass (train_step, forward, gather_trace) of any stage:
  /// stages share the connection's tags, so their passes take turns.
  std::mutex passes_mutex;

 private:
  void listen();
  // Records the first failure and aborts the receives and sends in
  // progress; returns true if this one was the first.
  bool record_failure(const std::string& message);
  // Posts a receive of `bytes` bytes from `peer` on `tag` (registered, so
  // that a failure aborts it), and waits for it. Waiting throws the failure
  // when aborted, and fails the connection on a c10d error.
  PostedBytes post_bytes(int64_t peer, int tag, int64_t bytes);
  torch::Tensor wait_bytes(
      int64_t peer, PostedBytes posted, const std::string& what);
  torch::Tensor receive_bytes(
      int64_t peer, int tag, int64_t bytes, const std::string& what) {
    return wait_bytes(peer, post_bytes(peer, tag, bytes), what);
  }
  [[noreturn]] void throw_failure() const;
  // Note [Who a collective waits for] in connection_collectives.cpp: this
  // rank has waited a while in collective `collective`; and, after a
  // timeout, the ranks that had not reached it, in words (empty when the
  // store cannot tell).
  void mark_arrival(int64_t collective);
  std::string absent_from(int64_t collective) const;
  // Note [A rank that left]: said on the store when the connection goes
  // without a failure; "rank 2 had left (...)" for those of the others
  // that said so, else "".
  void say_leaving();
  std::string who_left() const;
  // Note [What a rank waits for]: the listener says (or takes back) under
  // this rank's key of the job's store what this rank has long waited for.
  void note_long_waits();
  // When the connection goes: takes back what note_long_waits said, unless
  // a failure keeps it for the ranks that read it.
  void take_back_note();
  // " (rank 2 was waiting for ...)" where rank `peer` of this World said
  // so, else "".
  std::string peer_waits(int64_t peer) const;

  mutable std::mutex mutex_;
  std::optional<std::string> failure_;  // guarded by mutex_
  std::condition_variable failure_cv_;  // failure_ was set
  // Receives posted and sends waited on: a failure aborts them, so that no
  // rank waits out the timeout for a peer that already failed.
  std::set<c10::intrusive_ptr<c10d::Work>> waiting_;  // guarded by mutex_
  // The peer of each send posted and not yet waited for (wait_sends names
  // the rank that did not take it).
  std::map<const c10d::Work*, int64_t> send_peers_;
  // The receives being waited for, with their peer, what they bring and
  // when the wait began (Note [What a rank waits for]).
  struct Wait {
    int64_t peer = 0;
    const std::string* what = nullptr;  // the waiter's, alive while listed
    std::chrono::steady_clock::time_point since;
  };
  std::map<const c10d::Work*, Wait> waits_;  // guarded by mutex_
  // Lists a wait in waits_ for as long as it lives (on a failure, until
  // the failure is recorded: the note stays for the ranks that read it).
  class Listed {
   public:
    Listed(Connection& c, const c10d::Work* work, Wait wait);
    Listed(const Listed&) = delete;
    Listed& operator=(const Listed&) = delete;
    ~Listed();

   private:
    Connection& connection_;
    const c10d::Work* work_;
  };
  std::string noted_;  // what the listener last said; its own
  // Agreed layouts, by (peer, tag): what was last sent and last received.
  std::map<std::pair<int64_t, int>, std::vector<int64_t>> sent_layouts_;
  std::map<std::pair<int64_t, int>, std::vector<int64_t>> received_layouts_;
  std::mutex layouts_mutex_;  // guards both maps
  std::atomic<bool> stopping_{false};
  std::atomic<bool> store_gone_{false};  // see store_gone_note
  std::thread listener_;
  int64_t stage_ids_ = 0;
  std::atomic<int64_t> split_ids_{0};
  // Collectives waited for on this World, in order: the next one's number.
  std::atomic<int64_t> collectives_{0};
};

/// What a collective on a World's group begins with (Note [The first
/// collective's words] in connection_collectives.cpp).
enum class FirstCollective : int64_t {
  AllReduce = 1,  // World::all_reduce
  Broadcast = 2,  // World::broadcast
  TrainStep = 3,  // a training step's, over the replicas (Mesh::data())
  Barrier = 4,    // World::barrier
  Split = 5,      // World::split
  Mesh = 6,       // Mesh's constructor (its pipeline size)
  Stage = 7,      // PipelineStage's constructor, over the replicas
  // A training step's on a replica's stage after the first: begun as the
  // step begins and read at its end, after its gradient all-reduces began.
  StepStart = 8,
};

/// A first collective begun and not yet waited for.
struct PendingFirstCollective {
  FirstCollective kind = FirstCollective::AllReduce;
  std::string what;
  torch::Tensor words;   // where the result lands
  torch::Tensor staged;  // on the group's device (words itself on CPU)
  c10::intrusive_ptr<c10d::Work> work;
};

/// first_collective in two halves: begun now, without waiting; finished
/// (waited for and checked as first_collective does) later. Collectives
/// begun between the two follow it on every rank.
PendingFirstCollective start_first_collective(
    Connection& connection,
    FirstCollective kind,
    const std::array<int64_t, 4>& args,
    int64_t refused,
    const std::string& what);
std::vector<int64_t> finish_first_collective(
    Connection& connection, PendingFirstCollective& pending);

/// The first collective of a `kind` of operation on `connection`'s group:
/// a maximum over the ranks of 11 numbers, {kind, args, -args, refused,
/// -kind}. Throws a c10::ValueError when the ranks ran other kinds; else
/// returns the numbers reduced.
std::vector<int64_t> first_collective(
    Connection& connection,
    FirstCollective kind,
    const std::array<int64_t, 4>& args,
    int64_t refused,
    const std::string& what);

}  // namespace gpipe::dist::detail
