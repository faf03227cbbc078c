#pragma once

// The transport of a pass whose stages live in several processes: messages
// between a local stage and a stage of another rank go over c10d (see Note
// [Messages between ranks] in dist/connection.h); those between local
// endpoints (the pass's own input and output, a skip within the rank) stay
// in process.

#include <gpipe/trace.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "dist/connection.h"
#include "engine/in_process_transport.h"
#include "engine/transport.h"

namespace gpipe::dist::detail {

/// Where a pass's stages are: the rank of each stage and a number for each
/// skip that crosses stages.
struct Routes {
  std::vector<int64_t> rank_of_stage;
  std::map<gpipe::SkipKey, int64_t> skip_index;
  /// The skips' routes: (stashing stage, popping stage).
  std::map<gpipe::SkipKey, std::pair<int64_t, int64_t>> skip_route;
};

class C10dTransport final : public gpipe::detail::Transport {
 public:
  C10dTransport(
      std::shared_ptr<Connection> connection,
      int64_t pass,
      int64_t micro_batches,
      int64_t stages,
      const Routes& routes,
      std::shared_ptr<gpipe::Trace> trace);
  ~C10dTransport() override;

  void send(
      gpipe::Phase phase,
      int64_t i,
      int64_t k,
      gpipe::detail::Packet packet) override;
  gpipe::detail::Packet recv(gpipe::Phase phase, int64_t i, int64_t k) override;
  /// Posts the receive of a boundary message from another rank, which
  /// `recv` then completes.
  void prefetch(gpipe::Phase phase, int64_t i, int64_t k) override;
  void send_skip(
      gpipe::Phase phase,
      int64_t i,
      const gpipe::SkipKey& key,
      torch::Tensor t) override;
  torch::Tensor recv_skip(
      gpipe::Phase phase, int64_t i, const gpipe::SkipKey& key) override;
  void abort() override;
  void abort_with(const std::string& why) override;
  void relay(const std::string& failure) override;
  bool aborted() const override;
  std::string failure() const override;

  /// Sends a message of the driver's (begin, loss, trace) to `peer`.
  void send_message(int64_t peer, const MessageId& id, const Message& m);
  Message recv_message(int64_t peer, const MessageId& id);
  /// Waits for every send of the pass to finish (traced as "send").
  void finish();

 private:
  int64_t me() const {
    return connection_->rank;
  }
  // The rank a message at boundary k goes to (forward: stage k, the pass's
  // output for k == n; backward: stage k - 1, the pass's input grads for
  // k == 0), and the rank it comes from.
  int64_t destination(gpipe::Phase phase, int64_t k) const;
  int64_t source(gpipe::Phase phase, int64_t k) const;
  Message receive_traced(int64_t peer, const MessageId& id);
  // Waits for a posted receive (traced as "receive").
  Message complete_traced(PostedReceive posted);
  static MessageId boundary_message(gpipe::Phase phase, int64_t i, int64_t k);

  std::shared_ptr<Connection> connection_;
  const int64_t pass_;
  const int64_t n_;
  const Routes& routes_;
  std::shared_ptr<gpipe::Trace> trace_;
  gpipe::detail::InProcessTransport local_;
  std::mutex sends_mutex_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;  // guarded
  // Receives posted by prefetch, by (phase, micro-batch, boundary).
  std::mutex posted_mutex_;
  std::map<std::tuple<int, int64_t, int64_t>, PostedReceive> posted_;
};

}  // namespace gpipe::dist::detail
