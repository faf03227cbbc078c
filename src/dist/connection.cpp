#include "dist/connection.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <cstring>
#include <sstream>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "text.h"

namespace gpipe::dist::detail {

void keep_forever(c10::intrusive_ptr<c10::intrusive_ptr_target> object) {
  // Never destroyed: a World destroyed at exit may still call this.
  static auto* mutex = new std::mutex();
  static auto* kept =
      new std::vector<c10::intrusive_ptr<c10::intrusive_ptr_target>>();
  std::lock_guard<std::mutex> lock(*mutex);
  kept->push_back(std::move(object));
}

namespace {

// A channel kept for good after a failure, with the group it sends on.
struct KeptChannel : c10::intrusive_ptr_target {
  explicit KeptChannel(std::shared_ptr<Channel> c) : channel(std::move(c)) {}
  std::shared_ptr<Channel> channel;
};

}  // namespace

Connection::Connection(
    c10::intrusive_ptr<c10d::Store> store_,
    Groups groups_,
    int64_t rank_,
    int64_t size_,
    int64_t local_rank_,
    int64_t local_size_,
    std::chrono::milliseconds timeout_,
    GroupFactory make_group_,
    c10::intrusive_ptr<c10d::Store> job_store_,
    std::vector<int64_t> global_ranks_)
    : store(std::move(store_)),
      job_store(job_store_ ? std::move(job_store_) : store),
      groups(std::move(groups_)),
      rank(rank_),
      size(size_),
      local_rank(local_rank_),
      local_size(local_size_),
      timeout(timeout_),
      make_group(std::move(make_group_)),
      global_ranks(std::move(global_ranks_)) {
  if (size > 1) {
    listener_ = std::thread([this] { listen(); });
  }
}

Connection::~Connection() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  failure_cv_.notify_all();
  if (listener_.joinable()) {
    listener_.join();
  }
  take_back_note();
  if (!failure_) {
    say_leaving();
  }
  if (failure_) {
    // Receives may still be posted into the group: leave it alone.
    keep_forever(std::move(groups.group));
    if (groups.channel) {
      // (Its receives, if any, were aborted with the failure.)
      keep_forever(c10::make_intrusive<KeptChannel>(std::move(groups.channel)));
    }
  }
}

namespace {

// The store keys of the control plane: how many ranks failed, and the
// first one's message.
const char* const kFailures = "failures";
const char* const kFailure = "failure";
constexpr auto kPollInterval = std::chrono::milliseconds(20);

}  // namespace

void Connection::listen() {
  // Polls the store for another rank's failure (see Note [Failure notices]).
  // After a failure it goes on checking, only so that a store whose host
  // ended is noticed and let go of (Note [Letting go of a store whose host
  // ended] in store_client.h).
  bool heard = false;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      failure_cv_.wait_for(lock, kPollInterval, [this, heard] {
        return stopping_.load() || (!heard && failure_.has_value());
      });
      if (stopping_) {
        return;
      }
      heard = heard || failure_.has_value();
    }
    std::string text;
    try {
      if (!heard) {
        note_long_waits();
      }
      if (!store->check({kFailure}) || heard) {
        continue;
      }
      const auto value = store->get(kFailure);
      text.assign(value.begin(), value.end());
    } catch (...) {
      // The store went away (its host ended): receives from the ranks
      // that ended fail by themselves.
      store_gone_ = true;
      return;
    }
    record_failure(text);
    heard = true;
  }
}

bool Connection::record_failure(const std::string& message) {
  std::set<c10::intrusive_ptr<c10d::Work>> waiting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) {
      return false;
    }
    failure_ = message;
    waiting.swap(waiting_);
  }
  failure_cv_.notify_all();
  for (const auto& work : waiting) {
    work->abort();
  }
  if (groups.channel) {
    groups.channel->abort();
  }
  return true;
}

void Connection::fail(const std::string& message) {
  if (!record_failure(message)) {
    return;
  }
  // Tell the others: the first rank to fail writes its message where their
  // listeners look (the store answers before this returns, so the notice
  // is out even if this process exits next).
  try {
    if (store->add(kFailures, 1) == 1) {
      store->set(
          kFailure, std::vector<uint8_t>(message.begin(), message.end()));
    }
  } catch (...) {
    // The store is gone: the others learn of it from their own receives.
    store_gone_ = true;
  }
}

std::string Connection::store_gone_note() const {
  return store_gone_ ? "; the job's store is gone too (its host ended: rank "
                       "0, or torchrun's agent)"
                     : "";
}

void Connection::fail_with(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const gpipe::detail::RelayedFailure& e) {
    fail(e.origin());
  } catch (...) {
    fail(rank_name(rank) + ": " + message_of(std::current_exception()));
  }
}

std::optional<std::string> Connection::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::string with_closing_note(const std::string& failure) {
  static const std::string note =
      " (gpipe::dist: the connection between ranks is closed after a "
      "failure; restart the job)";
  if (failure.size() >= note.size() &&
      failure.compare(failure.size() - note.size(), note.size(), note) == 0) {
    return failure;
  }
  return failure + note;
}

void Connection::throw_failure() const {
  const auto f = failure();
  const auto origin = f ? *f : std::string("the connection failed");
  // Without LibTorch's backtrace: Note [Errors without LibTorch's backtrace]
  // in src/text.h.
  throw gpipe::detail::RelayedFailure(origin, with_closing_note(origin));
}

void Connection::check() const {
  if (failure()) {
    throw_failure();
  }
}

PostedBytes Connection::post_bytes(int64_t peer, int tag, int64_t n) {
  PostedBytes posted;
  posted.buffer = bytes(n);
  std::lock_guard<std::mutex> lock(mutex_);
  // Thrown when waited for: throw_failure() takes mutex_ itself.
  posted.failed = failure_.has_value();
  if (!posted.failed) {
    try {
      posted.work = groups.channel->recv(posted.buffer, peer, tag);
    } catch (const std::exception&) {
      posted.refused = message_of(std::current_exception());  // when waited for
    }
    if (posted.work) {
      waiting_.insert(posted.work);
    }
  }
  return posted;
}

torch::Tensor Connection::wait_bytes(
    int64_t peer, PostedBytes posted, const std::string& what) {
  auto& work = posted.work;
  const auto& refused = posted.refused;
  auto& buffer = posted.buffer;
  const bool failed = posted.failed;
  if (failed) {
    throw_failure();
  }
  bool received = false;
  std::string error;
  // Note [What a rank waits for] in connection_waits.cpp.
  std::optional<Listed> listed;
  if (work) {
    listed.emplace(
        *this, work.get(), Wait{peer, &what, std::chrono::steady_clock::now()});
    try {
      received = work->wait(timeout);
    } catch (const std::exception&) {
      error = message_of(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.erase(work);
  } else {
    error = refused.empty() ? "c10d refused the receive" : refused;
  }
  if (received) {
    return buffer;
  }
  const bool timed_out = error.find("imed out") != std::string::npos;
  if (!error.empty()) {
    // A peer that failed (or, timing out in a collective, learned whom it
    // waited for) tells first: its notice, not this wait, is the report.
    await_failure_notice();
  }
  if (!error.empty()) {
    std::ostringstream message;
    message << rank_name(rank) << " was waiting for " << what << " from "
            << rank_name(peer) << " and "
            << (timed_out ? "gave up after " : "lost the connection: ")
            << (timed_out ? std::to_string(timeout.count() / 1000) +
                                " s (GPIPE_DIST_TIMEOUT): " + rank_name(peer) +
                                " stopped answering, or runs other passes" +
                                peer_waits(peer)
                          : rank_name(peer) + " died or closed its connection")
            << store_gone_note() << " [c10d: " << error.substr(0, 300) << "]";
    fail(message.str());
  }
  keep_forever(std::move(work));  // aborted: c10d may still write into it
  throw_failure();
}

void Connection::send(
    int64_t peer,
    int64_t pass,
    const MessageId& id,
    const Message& message,
    std::vector<c10::intrusive_ptr<c10d::Work>>& pending) {
  check();
  const int tag = id.tag();
  auto layout = layout_of(message);
  bool atomic = true;
  std::vector<TensorSpec> specs;
  TORCH_INTERNAL_ASSERT(parse_layout(layout, atomic, specs));
  const auto payload = payload_bytes(specs);
  std::optional<std::vector<int64_t>> agreed;
  {
    std::lock_guard<std::mutex> lock(layouts_mutex_);
    auto it = sent_layouts_.find({peer, tag});
    if (it != sent_layouts_.end()) {
      agreed = it->second;
    }
    sent_layouts_[{peer, tag}] = layout;
  }
  auto header = [&](torch::Tensor& buffer, Mode mode) {
    auto* w = words(buffer);
    w[kMagicWord] = kMagic;
    w[kPassWord] = pass;
    w[kKindWord] = static_cast<int64_t>(id.kind);
    w[kMicroWord] = id.micro_batch;
    w[kIndexWord] = id.index;
    w[kLayoutWord] = static_cast<int64_t>(layout.size());
    w[kPayloadWord] = payload;
    w[kModeWord] = mode;
  };
  auto post = [&](torch::Tensor buffer) {
    try {
      pending.push_back(groups.channel->send(std::move(buffer), peer, tag));
      std::lock_guard<std::mutex> lock(mutex_);
      send_peers_[pending.back().get()] = peer;
    } catch (const std::exception&) {
      fail(
          rank_name(rank) + " could not send " + id.describe() + " to " +
          rank_name(peer) + ": " + rank_name(peer) +
          " died or closed its connection" + store_gone_note() + " [c10d: " +
          message_of(std::current_exception()).substr(0, 300) + "]");
      throw_failure();
    }
  };
  if (agreed && *agreed == layout) {
    auto buffer = bytes(kHeaderBytes + payload);
    header(buffer, kCombined);
    write_payload(message, buffer, kHeaderBytes);
    post(std::move(buffer));
    return;
  }
  int64_t first = kHeaderBytes;
  if (agreed) {
    bool a = true;
    std::vector<TensorSpec> old;
    TORCH_INTERNAL_ASSERT(parse_layout(*agreed, a, old));
    first += payload_bytes(old);
  }
  // A relayout message has the agreed size; its payload part is unused.
  auto head = agreed ? torch::zeros({first}, torch::kByte) : bytes(first);
  header(head, agreed ? kRelayout : kHeaderOnly);
  post(std::move(head));
  const auto layout_bytes = static_cast<int64_t>(layout.size()) * 8;
  auto body = bytes(layout_bytes + payload);
  std::memcpy(body.data_ptr(), layout.data(), layout_bytes);
  write_payload(message, body, layout_bytes);
  post(std::move(body));
}

Message Connection::recv(int64_t peer, int64_t pass, const MessageId& id) {
  return complete_recv(post_recv(peer, pass, id));
}

PostedReceive Connection::post_recv(
    int64_t peer, int64_t pass, const MessageId& id) {
  PostedReceive posted;
  posted.peer = peer;
  posted.pass = pass;
  posted.id = id;
  const int tag = id.tag();
  {
    std::lock_guard<std::mutex> lock(layouts_mutex_);
    auto it = received_layouts_.find({peer, tag});
    if (it != received_layouts_.end()) {
      posted.agreed = it->second;
    }
  }
  int64_t first = kHeaderBytes;
  if (posted.agreed) {
    bool atomic = true;
    std::vector<TensorSpec> specs;
    TORCH_INTERNAL_ASSERT(parse_layout(*posted.agreed, atomic, specs));
    first += payload_bytes(specs);
  }
  posted.head = post_bytes(peer, tag, first);
  return posted;
}

void Connection::abandon(PostedReceive& posted) {
  if (posted.head.work) {
    keep_forever(std::move(posted.head.work));
  }
  if (posted.head.buffer.defined()) {
    keep_forever(posted.head.buffer.getIntrusivePtr());
    posted.head.buffer = torch::Tensor();
  }
}

Message Connection::complete_recv(PostedReceive posted) {
  const auto peer = posted.peer;
  const auto pass = posted.pass;
  const auto& id = posted.id;
  const int tag = id.tag();
  const auto what = id.describe();
  const auto& agreed = posted.agreed;
  bool atomic = true;
  std::vector<TensorSpec> specs;
  int64_t first = kHeaderBytes;
  if (agreed) {
    TORCH_INTERNAL_ASSERT(parse_layout(*agreed, atomic, specs));
    first += payload_bytes(specs);
  }
  auto head = wait_bytes(peer, std::move(posted.head), what);
  const auto* w = words(head);
  auto refuse = [&](const std::string& why) {
    std::ostringstream message;
    message << rank_name(rank) << " expected " << what << " of "
            << describe_pass(pass) << " from " << rank_name(peer) << ", but "
            << why;
    fail(message.str());
    throw_failure();
  };
  if (w[kMagicWord] != kMagic) {
    refuse(
        "got bytes that are not a gpipe message: is " + rank_name(peer) +
        " running the same program?");
  }
  if (w[kPassWord] != pass) {
    refuse(
        rank_name(peer) + " sent it for " + describe_pass(w[kPassWord]) +
        ": every rank must run the same passes (train_step, forward) in the "
        "same order");
  }
  if (w[kKindWord] != static_cast<int64_t>(id.kind) ||
      w[kMicroWord] != id.micro_batch || w[kIndexWord] != id.index) {
    refuse(
        "got " +
        MessageId{
            static_cast<MessageKind>(w[kKindWord]),
            w[kMicroWord],
            w[kIndexWord]}
            .describe());
  }
  const auto mode = w[kModeWord];
  if (mode == kCombined) {
    if (!agreed || w[kLayoutWord] != static_cast<int64_t>(agreed->size()) ||
        w[kPayloadWord] != first - kHeaderBytes) {
      refuse("its layout is not the one both sides agreed on");
    }
    return read_payload(head, kHeaderBytes, atomic, specs);
  }
  if (mode != kHeaderOnly && mode != kRelayout) {
    refuse("its header is malformed");
  }
  const auto layout_words = w[kLayoutWord];
  const auto payload = w[kPayloadWord];
  if (layout_words < 2 || layout_words > (int64_t{1} << 20) || payload < 0) {
    refuse("its header is malformed");
  }
  auto body = receive_bytes(peer, tag, layout_words * 8 + payload, what);
  std::vector<int64_t> layout(
      words(body), words(body) + static_cast<size_t>(layout_words));
  if (!parse_layout(layout, atomic, specs) || payload_bytes(specs) != payload) {
    refuse("its layout is malformed");
  }
  {
    std::lock_guard<std::mutex> lock(layouts_mutex_);
    received_layouts_[{peer, tag}] = layout;
  }
  return read_payload(body, layout_words * 8, atomic, specs);
}

void Connection::wait_sends(
    std::vector<c10::intrusive_ptr<c10d::Work>>& pending) {
  for (auto& work : pending) {
    {
      // A failure from now on aborts the send (a peer that failed never
      // takes it).
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_) {
        break;
      }
      waiting_.insert(work);
    }
    bool sent = false;
    std::string error;
    try {
      sent = work->wait(timeout);
    } catch (const std::exception&) {
      error = message_of(std::current_exception());
    }
    int64_t peer = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      waiting_.erase(work);
      const auto it = send_peers_.find(work.get());
      if (it != send_peers_.end()) {
        peer = it->second;
        send_peers_.erase(it);
      }
    }
    const auto other =
        peer >= 0 ? rank_name(peer) : std::string("another rank");
    if (!sent) {
      // A send completes when its receiver takes it. (Not sent and no
      // error: aborted by a failure, which fail() leaves as it is.)
      const bool timed_out = error.find("imed out") != std::string::npos;
      if (!error.empty()) {
        await_failure_notice();
      }
      fail(
          rank_name(rank) +
          (timed_out
               ? " gave up after " + std::to_string(timeout.count() / 1000) +
                     " s (GPIPE_DIST_TIMEOUT) waiting for " + other +
                     " to take its messages: that rank stopped answering, or "
                     "runs other passes"
               : " could not finish sending to " + other + ": " + other +
                     " died or closed its connection" + store_gone_note()) +
          " [c10d: " + error.substr(0, 300) + "]");
    }
  }
  if (failure()) {
    for (auto& work : pending) {
      keep_forever(std::move(work));  // still posted: leave it alone
    }
    pending.clear();
    throw_failure();
  }
  pending.clear();
}

}  // namespace gpipe::dist::detail
