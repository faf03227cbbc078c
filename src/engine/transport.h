#pragma once

// Transport: how activations, gradients and skip tensors move between
// stages, and how a pass is aborted. Stages compute and never move data;
// the plan runner asks the transport for a cell's inputs and hands it the
// cell's outputs. In one process the transport is slots and condition
// variables (InProcessTransport); across processes it is c10d
// point-to-point with checked headers. Stage and plan code see only this
// interface.

#include <gpipe/schedule.h>
#include <gpipe/skip.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

#include "packet.h"

namespace gpipe::detail {

/// Thrown by a receive once the pass is aborted; never reaches a user (the
/// error that aborted the pass does).
struct Aborted {};

/// Boundary k of a pipeline of n stages sits before stage k: boundary 0 is
/// the pipeline's input, boundary n its output. Forward messages at boundary
/// k go into stage k; backward messages at boundary k go into stage k - 1
/// (the gradient of stage k - 1's output).
///
/// A boundary tensor's `requires_grad()` says whether the tensor it stands
/// for would require grad in the plain model; a transport keeps it.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual void send(
      Phase phase, int64_t micro_batch, int64_t boundary, Packet packet) = 0;
  /// Waits for the message; throws Aborted when the pass is aborted first.
  virtual Packet recv(Phase phase, int64_t micro_batch, int64_t boundary) = 0;
  /// Says that `recv(phase, micro_batch, boundary)` comes later (a plan's
  /// listed receive): a transport that must post receives posts it now, so
  /// that the message can arrive before the cell that needs it starts. In
  /// one process there is nothing to post.
  virtual void prefetch(Phase phase, int64_t micro_batch, int64_t boundary) {}

  /// A skip between stages: the stashed tensor in forward, its gradient in
  /// backward.
  virtual void send_skip(
      Phase phase,
      int64_t micro_batch,
      const SkipKey& key,
      torch::Tensor tensor) = 0;
  virtual torch::Tensor recv_skip(
      Phase phase, int64_t micro_batch, const SkipKey& key) = 0;

  /// Ends the pass: every receive waiting now or later throws Aborted.
  virtual void abort() = 0;
  /// Ends the pass because of `why` (the first error's message), which a
  /// transport to other processes passes on to them.
  virtual void abort_with(const std::string& why) {
    abort();
  }
  /// Ends the pass because of another process's failure, met here:
  /// `failure` (its message, naming where it happened) is passed on as it
  /// came.
  virtual void relay(const std::string& failure) {
    abort();
  }
  /// Why the pass was ended from outside this process (another rank
  /// failed); empty when it was not. Cells skipped because of it leave no
  /// error of their own, so the runner reports this one.
  virtual std::string failure() const {
    return {};
  }
  virtual bool aborted() const = 0;
};

}  // namespace gpipe::detail
