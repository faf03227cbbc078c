#include "dist/c10d_transport.h"

#include <c10/util/Exception.h>

#include <optional>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace gpipe::dist::detail {

using gpipe::Phase;
using gpipe::detail::Packet;

C10dTransport::C10dTransport(
    std::shared_ptr<Connection> connection,
    int64_t pass,
    int64_t m,
    int64_t n,
    const Routes& routes,
    std::shared_ptr<gpipe::Trace> trace)
    : connection_(std::move(connection)),
      pass_(pass),
      n_(n),
      routes_(routes),
      trace_(std::move(trace)),
      local_(m, n) {}

C10dTransport::~C10dTransport() {
  {
    // The pass failed before they were needed: c10d may still write into
    // them.
    std::lock_guard<std::mutex> lock(posted_mutex_);
    for (auto& [key, posted] : posted_) {
      Connection::abandon(posted);
    }
  }
  std::lock_guard<std::mutex> lock(sends_mutex_);
  if (!sends_.empty()) {
    // The pass failed before finish(): the sends may never complete.
    for (auto& work : sends_) {
      keep_forever(std::move(work));
    }
  }
}

int64_t C10dTransport::destination(Phase phase, int64_t k) const {
  const auto& ranks = routes_.rank_of_stage;
  if (phase == Phase::Forward) {
    return ranks[std::min(k, n_ - 1)];
  }
  return ranks[std::max<int64_t>(k - 1, 0)];
}

int64_t C10dTransport::source(Phase phase, int64_t k) const {
  const auto& ranks = routes_.rank_of_stage;
  if (phase == Phase::Forward) {
    return ranks[std::max<int64_t>(k - 1, 0)];
  }
  return ranks[std::min(k, n_ - 1)];
}

MessageId C10dTransport::boundary_message(Phase phase, int64_t i, int64_t k) {
  return MessageId{
      phase == Phase::Forward ? MessageKind::Forward : MessageKind::Backward,
      i,
      k};
}

void C10dTransport::send(Phase phase, int64_t i, int64_t k, Packet packet) {
  const auto peer = destination(phase, k);
  if (peer == me()) {
    local_.send(phase, i, k, std::move(packet));
    return;
  }
  send_message(
      peer,
      boundary_message(phase, i, k),
      Message{std::move(packet.tensors), packet.atomic});
}

void C10dTransport::prefetch(Phase phase, int64_t i, int64_t k) {
  const auto peer = source(phase, k);
  if (peer == me()) {
    return;
  }
  const auto key = std::make_tuple(static_cast<int>(phase), i, k);
  std::lock_guard<std::mutex> lock(posted_mutex_);
  TORCH_INTERNAL_ASSERT(posted_.count(key) == 0);  // validate() rules it out
  posted_.emplace(
      key, connection_->post_recv(peer, pass_, boundary_message(phase, i, k)));
}

Packet C10dTransport::recv(Phase phase, int64_t i, int64_t k) {
  const auto peer = source(phase, k);
  if (peer == me()) {
    return local_.recv(phase, i, k);
  }
  std::optional<PostedReceive> posted;
  {
    std::lock_guard<std::mutex> lock(posted_mutex_);
    auto it = posted_.find(std::make_tuple(static_cast<int>(phase), i, k));
    if (it != posted_.end()) {
      posted = std::move(it->second);
      posted_.erase(it);
    }
  }
  const auto id = boundary_message(phase, i, k);
  auto m =
      posted ? complete_traced(std::move(*posted)) : receive_traced(peer, id);
  return Packet{std::move(m.tensors), m.atomic};
}

void C10dTransport::send_skip(
    Phase phase, int64_t i, const gpipe::SkipKey& key, torch::Tensor t) {
  const auto route = routes_.skip_route.at(key);
  const auto stage = phase == Phase::Forward ? route.second : route.first;
  const auto peer = routes_.rank_of_stage[stage];
  if (peer == me()) {
    local_.send_skip(phase, i, key, std::move(t));
    return;
  }
  const MessageId id{
      phase == Phase::Forward ? MessageKind::ForwardSkip
                              : MessageKind::BackwardSkip,
      i,
      routes_.skip_index.at(key)};
  send_message(peer, id, Message{{std::move(t)}, true});
}

torch::Tensor C10dTransport::recv_skip(
    Phase phase, int64_t i, const gpipe::SkipKey& key) {
  const auto route = routes_.skip_route.at(key);
  const auto from = phase == Phase::Forward ? route.first : route.second;
  const auto peer = routes_.rank_of_stage[from];
  if (peer == me()) {
    return local_.recv_skip(phase, i, key);
  }
  const MessageId id{
      phase == Phase::Forward ? MessageKind::ForwardSkip
                              : MessageKind::BackwardSkip,
      i,
      routes_.skip_index.at(key)};
  auto m = receive_traced(peer, id);
  TORCH_CHECK(
      m.tensors.size() == 1,
      connection_->rank_name(me()),
      " expected one tensor for skip ",
      key,
      " from ",
      connection_->rank_name(peer),
      ", but got ",
      m.tensors.size());
  return std::move(m.tensors[0]);
}

void C10dTransport::send_message(
    int64_t peer, const MessageId& id, const Message& m) {
  std::vector<c10::intrusive_ptr<c10d::Work>> posted;
  try {
    connection_->send(peer, pass_, id, m, posted);
  } catch (...) {
    for (auto& work : posted) {
      keep_forever(std::move(work));  // may still be posted
    }
    throw;
  }
  std::lock_guard<std::mutex> lock(sends_mutex_);
  for (auto& work : posted) {
    sends_.push_back(std::move(work));
  }
}

Message C10dTransport::recv_message(int64_t peer, const MessageId& id) {
  return receive_traced(peer, id);
}

Message C10dTransport::receive_traced(int64_t peer, const MessageId& id) {
  return complete_traced(connection_->post_recv(peer, pass_, id));
}

Message C10dTransport::complete_traced(PostedReceive posted) {
  const auto start = std::chrono::steady_clock::now();
  const auto id = posted.id;
  auto m = connection_->complete_recv(std::move(posted));
  if (trace_) {
    trace_->record(
        me(),  // this rank's lane, whichever of its stages receives
        id.micro_batch,
        gpipe::TraceKind::Receive,
        start,
        std::chrono::steady_clock::now());
  }
  return m;
}

void C10dTransport::finish() {
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  {
    std::lock_guard<std::mutex> lock(sends_mutex_);
    sends.swap(sends_);
  }
  const auto start = std::chrono::steady_clock::now();
  // (wait_sends empties the list.)
  const bool sent = !sends.empty();
  connection_->wait_sends(sends);
  // The wait for every send of the pass: no one micro-batch's (-1), and
  // none where the pass sent nothing (a stage of one rank).
  if (trace_ && sent) {
    trace_->record(
        me(),
        -1,
        gpipe::TraceKind::Send,
        start,
        std::chrono::steady_clock::now());
  }
}

void C10dTransport::abort() {
  abort_with(connection_->rank_name(me()) + " aborted the pass");
}

void C10dTransport::abort_with(const std::string& why) {
  local_.abort();
  connection_->fail(connection_->rank_name(me()) + ": " + why);
}

void C10dTransport::relay(const std::string& failure) {
  local_.abort();
  connection_->fail(failure);
}

std::string C10dTransport::failure() const {
  auto f = connection_->failure();
  return f ? with_closing_note(*f) : std::string();
}

bool C10dTransport::aborted() const {
  return local_.aborted() || connection_->failure().has_value();
}

}  // namespace gpipe::dist::detail
