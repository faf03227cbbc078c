#pragma once

// The passes of a PipelineStage that every rank runs together (train_step,
// forward): one at a time on the connection, and how their errors end
// them, on one rank or on all.

#include <gpipe/microbatch.h>
#include <gpipe/options.h>
#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

#include "dist/connection.h"
#include "packet.h"

namespace gpipe::detail {
class Pipeline;
}  // namespace gpipe::detail

namespace gpipe::dist::detail {

using Sends = std::vector<c10::intrusive_ptr<c10d::Work>>;

/// An error that every rank meets at the same point of a pass from the same
/// facts (a plan they agreed on that does not fit the mini-batch they agreed
/// on), before any cell ran: each rank throws it and the connection stays
/// open, so the stage stays usable.
struct AgreedRefusal {
  std::exception_ptr error;
};

/// One collective pass: one pass at a time on the connection, the pipeline
/// held, a pass number; `body(pass, sends, held)` runs it, rank 0's begin
/// messages going into `sends`. Any error but an AgreedRefusal fails the
/// connection, so that every other rank stops with it instead of waiting.
torch::Tensor collective_pass(
    Connection& connection,
    gpipe::detail::Pipeline& pipeline,
    const std::function<int64_t()>& next_pass,
    const std::function<
        torch::Tensor(int64_t, Sends&, std::unique_lock<std::mutex>&)>& body);

/// Rank 0's input cut into micro-batches, as the packets a pass feeds in
/// (`call` names the caller, and `connection` the rank by its rank in the
/// job, in the error for an undefined input).
std::vector<gpipe::detail::Packet> scatter_input(
    const torch::Tensor& input,
    int64_t chunks,
    const char* call,
    const Connection& connection);

}  // namespace gpipe::dist::detail
