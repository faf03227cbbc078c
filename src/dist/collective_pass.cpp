// The passes every rank runs together: see dist/collective_pass.h.

#include "dist/collective_pass.h"

#include <gpipe/microbatch.h>
#include <gpipe/verify.h>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "engine/pipeline.h"

namespace gpipe::dist::detail {

torch::Tensor collective_pass(
    Connection& connection,
    gpipe::detail::Pipeline& pipeline,
    const std::function<int64_t()>& next_pass,
    const std::function<
        torch::Tensor(int64_t, Sends&, std::unique_lock<std::mutex>&)>& body) {
  std::lock_guard<std::mutex> passes(connection.passes_mutex);
  auto held = pipeline.begin_pass();
  connection.check();
  const auto pass = next_pass();
  Sends begin_sends;
  try {
    return body(pass, begin_sends, held);
  } catch (const AgreedRefusal& refusal) {
    // The others received the begin messages (they refuse after reading
    // them), so rank 0's sends complete.
    connection.wait_sends(begin_sends);
    std::rethrow_exception(refusal.error);
  } catch (...) {
    for (auto& work : begin_sends) {
      keep_forever(std::move(work));  // may still be posted
    }
    connection.fail_with(std::current_exception());
    throw;
  }
}

std::vector<gpipe::detail::Packet> scatter_input(
    const torch::Tensor& input,
    int64_t chunks,
    const char* call,
    const Connection& connection) {
  TORCH_CHECK_TYPE(
      input.defined(),
      call,
      " expects the input on ",
      connection.rank_name(0),
      " (the first stage's), but got an undefined tensor");
  verify_batch({input});
  std::vector<gpipe::detail::Packet> packets;
  for (auto& b : scatter({input}, chunks)) {
    packets.push_back(gpipe::detail::Packet{std::move(b), /*atomic=*/true});
  }
  return packets;
}

}  // namespace gpipe::dist::detail
