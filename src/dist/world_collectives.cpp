// World's collectives (all_reduce, broadcast, barrier): each agrees first
// on its arguments across the ranks, so that every rank refuses alike, and
// a collective that fails or times out closes the World on every rank.
// (World::split is in mesh.cpp.)

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <gpipe/dist.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "dist/backend.h"
#include "dist/connection.h"
#include "text.h"

namespace gpipe::dist {

// Note [A World's collectives from several threads]
// A World's collectives of one's own (all_reduce, broadcast, barrier,
// split) run one at a time on each rank: two threads that called them at
// once had their agreements' and their tensors' collectives interleave on
// the one c10d group, which summed one thread's tensor with the other's
// or, where their sizes differed, aborted the process in Gloo. As with
// any process group, the ranks' calls pair up in the order each rank
// makes them: threads that call at once on every rank may be paired in
// another order on another rank (the agreement refuses that where sizes
// or kinds differ, but not between two equal tensors), so calls from
// several threads want an order of the caller's, or a World each
// (World::split).

namespace {

// Waits for a collective of `connection`'s group; its failure is a
// c10::Error naming the operation and the rank, without c10d's backtrace.
void wait_collective(
    detail::Connection& connection,
    const char* what,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  connection.check();
  connection.closing_on_failure([&] {
    connection.wait_collective(start(), std::string("World::") + what);
  });
}

void check_collective_tensor(const torch::Tensor& tensor, const char* what) {
  TORCH_CHECK_VALUE(
      tensor.defined() && tensor.layout() == torch::kStrided &&
          tensor.is_contiguous(),
      "gpipe::dist::World::",
      what,
      " expects a dense contiguous tensor, but got ",
      tensor.defined() ? "one that is not" : "an undefined one");
  TORCH_CHECK_VALUE(
      !tensor.is_conj() && !tensor.is_neg(),
      "gpipe::dist::World::",
      what,
      " expects a tensor whose values are in its memory, but got a lazy ",
      tensor.is_conj() ? "conjugate" : "negation",
      " view (call resolve_conj() or resolve_neg() first)");
}

// Every rank's tensor in words, for an agreement that found the ranks'
// tensors unlike (every rank found it, so every rank comes): "rank 0: 6 of
// Float, shape [2, 3]; ranks 1 and 2: 6 of Float, shape [3, 2]". One more
// collective, on this failure path only.
std::string tensors_of_every_rank(
    detail::Connection& connection, const torch::Tensor& tensor) {
  constexpr int64_t kDims = 8;  // sizes told; more are '...'
  constexpr int64_t kWords = kDims + 3;
  const auto n = connection.size;
  auto words = torch::zeros({n, kWords}, torch::kLong);
  auto* mine = words.data_ptr<int64_t>() + connection.rank * kWords;
  mine[0] = static_cast<int64_t>(tensor.scalar_type());
  mine[1] = tensor.dim();
  mine[2] = tensor.numel();
  for (int64_t d = 0; d < std::min<int64_t>(tensor.dim(), kDims); ++d) {
    mine[3 + d] = tensor.size(d);
  }
  auto staged = detail::on_group_device(connection.groups, words);
  std::vector<torch::Tensor> tensors{staged};
  connection.closing_on_failure([&] {
    connection.all_reduce(
        tensors,
        c10d::ReduceOp::SUM,
        "World (telling the ranks' tensors apart)");
  });
  words = staged.cpu();
  // Ranks of alike tensors together, in the order they first come.
  std::vector<std::pair<std::string, std::vector<int64_t>>> kinds;
  for (int64_t r = 0; r < n; ++r) {
    const auto* w = words.data_ptr<int64_t>() + r * kWords;
    std::ostringstream shape;
    shape << "[";
    for (int64_t d = 0; d < std::min(w[1], kDims); ++d) {
      shape << (d == 0 ? "" : ", ") << w[3 + d];
    }
    if (w[1] > kDims) {
      shape << ", ... (" << w[1] << " dimensions)";
    }
    shape << "]";
    const auto text = c10::str(
        w[2],
        " of ",
        static_cast<c10::ScalarType>(w[0]),
        ", shape ",
        shape.str());
    auto kind = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) {
      return k.first == text;
    });
    if (kind == kinds.end()) {
      kinds.emplace_back(text, std::vector<int64_t>{});
      kind = std::prev(kinds.end());
    }
    kind->second.push_back(r);
  }
  std::string out;
  for (const auto& [text, ranks] : kinds) {
    std::vector<std::string> numbers;
    for (const auto r : ranks) {
      numbers.push_back(std::to_string(connection.global_rank(r)));
    }
    const auto names = gpipe::detail::listed(numbers);
    out += c10::str(
        out.empty() ? "" : "; ",
        ranks.size() == 1 ? "rank " : "ranks ",
        names,
        ": ",
        text);
  }
  return out;
}

// Gloo aborts the process (an enforce in its event-loop thread, which no
// caller can catch) when a rank receives more bytes than it posted: ranks
// that pass tensors of other sizes to one collective would end the job
// with SIGABRT. So a World's collective first agrees on what it is (Note
// [The first collective's words]), the tensor's size, dtype and shape (a
// hash of its sizes) and, for a broadcast, the root, in one collective of a
// few numbers (the largest of each and of its negative), and every rank
// refuses alike when they differ. So are the
// arguments a rank refuses on its own (`mine`: an undefined tensor, a root
// out of range): refused there alone, they left the others waiting in this
// agreement, which the refusing rank's next collective then answered,
// out of step. What no rank can do (a dtype the group cannot sum) is
// refused after it, alike too.
void agree_on_tensor(
    detail::Connection& connection,
    const torch::Tensor& tensor,
    detail::FirstCollective kind,
    const char* what,
    int64_t root,
    const std::exception_ptr& mine) {
  const bool usable = !mine && tensor.defined();
  const int64_t n = usable ? tensor.numel() : 0;
  const auto dtype = usable ? static_cast<int64_t>(tensor.scalar_type()) : 0;
  uint64_t hash = usable ? static_cast<uint64_t>(tensor.dim()) : 0;
  for (const auto size : usable ? tensor.sizes() : c10::IntArrayRef()) {
    hash = hash * 1000003u ^ static_cast<uint64_t>(size);
  }
  const auto shape = static_cast<int64_t>(hash >> 2);  // its negative fits
  // The last word: 1 + the highest rank that refused its own arguments.
  const int64_t refused = mine ? connection.rank + 1 : 0;
  const auto words = detail::first_collective(
      connection,
      kind,
      {n, dtype, shape, root},
      refused,
      std::string("World::") + what + " (its agreement on the tensor)");
  if (mine) {
    std::rethrow_exception(mine);
  }
  // After the kind: n, dtype, shape, root, their negatives, `refused`.
  const auto* w = words.data() + 1;
  TORCH_CHECK_VALUE(
      w[8] == 0,
      "gpipe::dist::World::",
      what,
      ": ",
      connection.rank_name(w[8] - 1),
      " refused its own arguments (its error says why), so every rank "
      "refuses this ",
      what,
      "; the World stays usable");
  const bool alike = w[0] == -w[4] && w[1] == -w[5] && w[2] == -w[6];
  const auto here =
      alike ? std::string()
            : " (" + tensors_of_every_rank(connection, tensor) + ")";
  TORCH_CHECK_VALUE(
      w[0] == -w[4] && w[1] == -w[5],
      "gpipe::dist::World::",
      what,
      " expects a tensor of the same size and dtype on every rank, but the "
      "ranks passed ",
      -w[4] == w[0] ? "tensors of other dtypes"
                    : "from " + std::to_string(-w[4]) + " to " +
                          std::to_string(w[0]) + " elements",
      here);
  TORCH_CHECK_VALUE(
      w[2] == -w[6],
      "gpipe::dist::World::",
      what,
      " expects a tensor of the same shape on every rank, but the ranks "
      "passed tensors of other shapes",
      here);
  TORCH_CHECK_VALUE(
      w[3] == -w[7],
      "gpipe::dist::World::",
      what,
      " expects the same root on every rank, but the ranks passed roots from ",
      -w[7],
      " to ",
      w[3],
      " (",
      connection.rank_name(connection.rank),
      ": ",
      root,
      ")");
}

// The error `check` throws, if any.
std::exception_ptr refused_by(const std::function<void()>& check) {
  try {
    check();
  } catch (const c10::Error&) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace

void World::all_reduce(torch::Tensor& tensor) const {
  // Note [A World's collectives from several threads].
  std::lock_guard<std::mutex> one_at_a_time(
      connection_->world_collectives_mutex);
  const auto mine =
      refused_by([&] { check_collective_tensor(tensor, "all_reduce"); });
  if (size() == 1 && mine) {
    std::rethrow_exception(mine);
  }
  if (size() == 1) {
    return;
  }
  agree_on_tensor(
      *connection_,
      tensor,
      detail::FirstCollective::AllReduce,
      "all_reduce",
      0,
      mine);
  // Every rank has this dtype now: all refuse it alike.
  TORCH_CHECK_VALUE(
      tensor.scalar_type() != torch::kBool && !tensor.is_complex(),
      "gpipe::dist::World::all_reduce sums, and expects a tensor of real "
      "numbers, but got ",
      tensor.scalar_type());
  // (A dtype the group does not sum is summed in a wider one.)
  auto summed = detail::summable_on_group_device(connection_->groups, tensor);
  std::vector<torch::Tensor> tensors{summed};
  connection_->closing_on_failure([&] {
    connection_->all_reduce(tensors, c10d::ReduceOp::SUM, "World::all_reduce");
  });
  if (!summed.is_same(tensor)) {
    tensor.copy_(summed);
  }
}

void World::broadcast(torch::Tensor& tensor, int64_t root) const {
  // Note [A World's collectives from several threads].
  std::lock_guard<std::mutex> one_at_a_time(
      connection_->world_collectives_mutex);
  const auto mine = refused_by([&] {
    check_collective_tensor(tensor, "broadcast");
    TORCH_CHECK_INDEX(
        root >= 0 && root < size(),
        "gpipe::dist::World::broadcast expects a root rank in [0, ",
        size(),
        "), but got ",
        root);
  });
  if (size() == 1 && mine) {
    std::rethrow_exception(mine);
  }
  if (size() == 1) {
    return;
  }
  agree_on_tensor(
      *connection_,
      tensor,
      detail::FirstCollective::Broadcast,
      "broadcast",
      root,
      mine);
  // Its bytes: a copy of any dtype.
  std::vector<torch::Tensor> tensors{detail::byte_view(tensor)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  connection_->check();
  connection_->closing_on_failure([&] {
    connection_->run_collective(
        tensors,
        [&](std::vector<torch::Tensor>& ts) {
          return connection_->group->broadcast(ts, options);
        },
        "World::broadcast");
  });
}

void World::barrier() const {
  // Note [A World's collectives from several threads].
  std::lock_guard<std::mutex> one_at_a_time(
      connection_->world_collectives_mutex);
  if (size() == 1) {
    return;
  }
  detail::first_collective(
      *connection_,
      detail::FirstCollective::Barrier,
      {0, 0, 0, 0},
      0,
      "World::barrier");
  c10d::BarrierOptions options;
  const auto& device = connection_->groups.device;
  // NCCL's barrier runs on the rank's GPU, and c10d makes its tensor on the
  // current device.
  c10::OptionalDeviceGuard guard;
  if (device.is_cuda() && device.has_index()) {
    options.device_ids = {device.index()};
    guard.reset_device(device);
  }
  wait_collective(*connection_, "barrier", [&] {
    return connection_->group->barrier(options);
  });
}

}  // namespace gpipe::dist
