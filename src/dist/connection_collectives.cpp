// Connection's collectives: waiting for one (woken by its end, a failure
// notice or the timeout), and running one on tensors staged on the
// backend's device (Note [Backends] in dist/backend.h).

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "dist/backend.h"
#include "dist/connection.h"
#include "text.h"

namespace gpipe::dist::detail {

// Note [Who a collective waits for]
// A collective that times out can only say that some rank did not come.
// So that it names which, a rank whose collective is still running after
// a quarter of the timeout (2 s at most) writes the collective's number on
// this World (they run in the same order on every rank) under its own key
// of the store: one store write, and only for a collective that waits that
// long. When it times out, it reads every rank's key: those that never
// wrote this collective's number had not reached it (they stopped, died,
// run something else, or came within that last quarter, 2 s at most), and
// are named. A rank that finished its part without waiting long (a
// broadcast's, while another rank was missing) wrote nothing and is named
// too: the message says what the store shows. Reading happens only on that
// failure path; a store that is gone leaves the message as it was.

// Note [A rank that left]
// A rank whose World goes (its process returned, or let it go) while the
// others still call collectives on it closes its connections, and of more
// than two ranks the others' Gloo errors cannot say whose: a closed pair
// names an address, not a rank. So a connection that goes without a
// failure says so under its own key of the store first (before its group,
// and so its sockets, close), and a collective that failed names the ranks
// that said so. A process killed outright says nothing: then the message
// stays "a rank died".

namespace {

constexpr const char* kArrivedKey = "arrived/";
constexpr const char* kLeftKey = "left/";

}  // namespace

std::string Connection::rank_names(const std::vector<int64_t>& ranks) const {
  std::vector<std::string> names;
  for (const auto r : ranks) {
    names.push_back(rank_name(r));
  }
  return gpipe::detail::listed(names);
}

void Connection::say_leaving() {
  if (size < 2 || store_gone_) {
    return;
  }
  try {
    store->set(kLeftKey + std::to_string(rank), std::vector<uint8_t>{1});
  } catch (...) {
    // The store is gone: the others' messages name nobody.
  }
}

std::string Connection::who_left() const {
  std::vector<int64_t> left;
  try {
    for (const auto r : c10::irange(size)) {
      if (r != rank && store->check({kLeftKey + std::to_string(r)})) {
        left.push_back(r);
      }
    }
  } catch (...) {
    return {};
  }
  return left.empty()
             ? std::string()
             : rank_names(left) + " had left (" +
                   (left.size() == 1 ? "its World was" : "their Worlds were") +
                   " let go: the process ended, after an error of its own or "
                   "not; see its own output)";
}

void Connection::mark_arrival(int64_t collective) {
  try {
    const auto text = std::to_string(collective);
    store->set(
        kArrivedKey + std::to_string(rank),
        std::vector<uint8_t>(text.begin(), text.end()));
  } catch (...) {
    // The store is gone: the timeout's message names nobody.
  }
}

std::string Connection::absent_from(int64_t collective) const {
  std::vector<int64_t> absent;
  try {
    for (const auto r : c10::irange(size)) {
      if (r == rank) {
        continue;
      }
      const auto key = kArrivedKey + std::to_string(r);
      int64_t reached = -1;
      if (store->check({key})) {
        const auto value = store->get(key);
        reached = std::stoll(std::string(value.begin(), value.end()));
      }
      if (reached < collective) {
        absent.push_back(r);
      }
    }
  } catch (...) {
    return {};
  }
  if (absent.empty()) {
    return "every rank had reached it, and one stopped answering in it";
  }
  const auto names = rank_names(absent);
  // Note [What a rank waits for] in connection.cpp.
  std::string waits;
  for (const auto r : absent) {
    const auto note = waiting_note(global_rank(r));
    if (!note.empty()) {
      waits += "; " + rank_name(r) + " was itself waiting " + note;
    }
  }
  return names + (absent.size() == 1 ? " had" : " had each") +
         " not reached it (stopped, died, or runs something else)" + waits;
}

void Connection::wait_collective(
    const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  // Its number on this World (Note [Who a collective waits for]).
  const auto collective = collectives_++;
  // Woken by the collective's end or by a failure notice, whichever comes
  // first (a collective cannot be aborted, so a failure leaves it).
  auto future = work->getFuture();
  std::weak_ptr<Connection> self = weak_from_this();
  future->addCallback([self](c10::ivalue::Future&) {
    if (auto connection = self.lock()) {
      std::lock_guard<std::mutex> lock(connection->mutex_);
      connection->failure_cv_.notify_all();
    }
  });
  // A GPU backend's future completes when the collective is queued on the
  // GPU (NCCL's does): there the work itself is polled for its end.
  const bool poll = groups.device.is_cuda();
  auto ended = [&] { return poll ? work->isCompleted() : future->completed(); };
  // Waits until `until`: true when the collective ended or a failure came.
  auto wait_until = [&](std::chrono::steady_clock::time_point until) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (ended() || failure_.has_value()) {
        return true;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) {
        return false;
      }
      const auto left = until - now;
      failure_cv_.wait_for(
          lock,
          poll ? std::min<std::chrono::steady_clock::duration>(
                     left, std::chrono::milliseconds(1))
               : left);
    }
  };
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  // Note [What a rank waits for] in connection_waits.cpp.
  const Listed listed(*this, work.get(), Wait{-1, &what, start});
  const auto mark_at =
      start + std::min<std::chrono::milliseconds>(
                  timeout / 4, std::chrono::milliseconds(2000));
  bool in_time = wait_until(mark_at);
  if (!in_time && size > 1) {
    mark_arrival(collective);
  }
  in_time = in_time || wait_until(deadline);
  if (!ended()) {
    keep_forever(work);  // Gloo may still write into its tensors
    check();
    // Note [Errors without LibTorch's backtrace] in src/text.h.
    if (!in_time) {
      const auto absent = size > 1 ? absent_from(collective) : std::string();
      gpipe::detail::fail_without_backtrace(c10::str(
          "gpipe::dist: the ",
          what,
          " did not end within ",
          timeout.count() / 1000.0,
          " s (GPIPE_DIST_TIMEOUT) on ",
          rank_name(rank),
          ": ",
          absent.empty()
              ? std::string("a rank stopped answering, or runs other "
                            "collectives")
              : absent));
    }
  }
  // Gloo's own exceptions (gloo::IoException when a peer's connection
  // closes, or after a timeout closed the pairs) are no c10::Error: each
  // becomes one, as every error of gpipe is.
  std::string error;
  try {
    work->wait(timeout);
  } catch (const std::exception&) {
    error = message_of(std::current_exception());
  }
  if (error.empty()) {
    return;
  }
  await_failure_notice();
  check();
  // A rank that said it left is named (Note [A rank that left]); else, of
  // two ranks, the other.
  const auto left = who_left();
  const auto who = !left.empty() ? left
                   : size == 2   ? rank_name(1 - rank) +
                                     " died, closed its "
                                     "connections or stopped "
                                     "answering"
                               : std::string(
                                     "a rank died, closed its connections or "
                                     "stopped answering");
  gpipe::detail::fail_without_backtrace(c10::str(
      "gpipe::dist: the ",
      what,
      " failed on ",
      rank_name(rank),
      ": ",
      who,
      store_gone_note(),
      " [c10d: ",
      error.substr(0, 300),
      "]"));
}

void Connection::closing_on_failure(const std::function<void()>& run) {
  try {
    run();
  } catch (const c10::Error&) {
    fail_with(std::current_exception());
    throw;
  }
}

void Connection::await_failure_notice() {
  std::unique_lock<std::mutex> lock(mutex_);
  failure_cv_.wait_for(lock, std::chrono::milliseconds(500), [this] {
    return failure_.has_value();
  });
}

void Connection::all_reduce(
    std::vector<torch::Tensor>& tensors,
    const c10d::ReduceOp& op,
    const std::string& what) {
  check();
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  run_collective(
      tensors,
      [&](std::vector<torch::Tensor>& ts) {
        return group->allreduce(ts, options);
      },
      what);
}

void Connection::run_collective(
    std::vector<torch::Tensor>& tensors,
    const std::function<
        c10::intrusive_ptr<c10d::Work>(std::vector<torch::Tensor>&)>& start,
    const std::string& what) {
  std::vector<torch::Tensor> staged;
  staged.reserve(tensors.size());
  bool moved = false;
  for (const auto& t : tensors) {
    staged.push_back(on_group_device(groups, t));
    moved = moved || !staged.back().is_same(t);
  }
  wait_collective(start(moved ? staged : tensors), what);
  if (moved) {
    for (const auto k : c10::irange(tensors.size())) {
      if (!staged[k].is_same(tensors[k])) {
        tensors[k].copy_(staged[k]);
      }
    }
  }
}

// Note [The first collective's words]
// Gloo aborts the process (an enforce in its event-loop thread) when a
// message is larger than the buffer its receiver posted, as when two ranks
// of one group run collectives of other sizes at once: a World::all_reduce
// of the user's on Mesh::data() on one rank while another runs a training
// step, whose first collective there averaged gradients or agreed on the
// shards. So every operation gpipe runs on a World's group begins with one
// collective of the same 11 numbers (a maximum): what it is, its four
// arguments, their negatives, a refusal, and its kind's negative. Ranks that
// began other operations see it at once and refuse alike, naming both. (A
// training step does so on a replica's first stage, which agrees with the
// other replicas' before the step: agree_to_start. The other stages begin
// theirs as the step begins and read it before their first gradient bucket
// starts, or at the step's end (start_first_collective): their step does
// not wait for the other replicas to start, and its failures are met where
// the gradient all-reduce's are, so that a rank killed in another replica
// is still named. The words of a step carry its buckets' layout: Note [The
// replicas' buckets agree] in dist/data_parallel.h.)
namespace {

const char* first_collective_name(int64_t kind) {
  switch (static_cast<FirstCollective>(kind)) {
    case FirstCollective::AllReduce:
      return "World::all_reduce";
    case FirstCollective::Broadcast:
      return "World::broadcast";
    case FirstCollective::TrainStep:
      return "train_step (its start over the replicas)";
    case FirstCollective::Barrier:
      return "World::barrier";
    case FirstCollective::Split:
      return "World::split";
    case FirstCollective::Mesh:
      return "the Mesh constructor";
    case FirstCollective::Stage:
      return "the PipelineStage constructor (the first replica's parameters)";
    case FirstCollective::StepStart:
      return "train_step (its start over the replicas, on a later stage)";
  }
  return "an unknown collective";
}

}  // namespace

PendingFirstCollective start_first_collective(
    Connection& connection,
    FirstCollective kind,
    const std::array<int64_t, 4>& args,
    int64_t refused,
    const std::string& what) {
  const auto k = static_cast<int64_t>(kind);
  PendingFirstCollective pending;
  pending.kind = kind;
  pending.what = what;
  pending.words = torch::tensor(
      std::vector<int64_t>{
          k,
          args[0],
          args[1],
          args[2],
          args[3],
          -args[0],
          -args[1],
          -args[2],
          -args[3],
          refused,
          -k},
      torch::kLong);
  connection.closing_on_failure([&] {
    connection.check();
    pending.staged = on_group_device(connection.groups, pending.words);
    std::vector<torch::Tensor> tensors{pending.staged};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    pending.work = connection.group->allreduce(tensors, options);
  });
  return pending;
}

std::vector<int64_t> finish_first_collective(
    Connection& connection, PendingFirstCollective& pending) {
  auto work = std::move(pending.work);
  pending.work.reset();
  connection.closing_on_failure(
      [&] { connection.wait_collective(work, pending.what); });
  if (!pending.staged.is_same(pending.words)) {
    pending.words.copy_(pending.staged);
  }
  const auto* w = pending.words.data_ptr<int64_t>();
  std::vector<int64_t> reduced(w, w + 11);
  if (reduced[0] == -reduced[10]) {
    return reduced;
  }
  const auto message = c10::str(
      "gpipe::dist: the ranks of a World ran other operations at once: ",
      first_collective_name(reduced[0]),
      " and ",
      first_collective_name(-reduced[10]),
      " (",
      connection.rank_name(connection.rank),
      " ran ",
      first_collective_name(static_cast<int64_t>(pending.kind)),
      "); every rank of a World must run the same collectives in the same "
      "order, and a collective of your own on Mesh::data() or "
      "Mesh::pipeline() waits for the others' training step to end");
  // A later stage's step has run its pass past these words (its buckets
  // wait for them, but the other side's collective does not): the World's
  // ranks are out of step for good, so it is closed on both sides.
  const auto step_start = static_cast<int64_t>(FirstCollective::StepStart);
  if (reduced[0] == step_start || -reduced[10] == step_start) {
    connection.fail(connection.rank_name(connection.rank) + ": " + message);
  }
  TORCH_CHECK_VALUE(false, message);
}

std::vector<int64_t> first_collective(
    Connection& connection,
    FirstCollective kind,
    const std::array<int64_t, 4>& args,
    int64_t refused,
    const std::string& what) {
  auto pending = start_first_collective(connection, kind, args, refused, what);
  return finish_first_collective(connection, pending);
}

}  // namespace gpipe::dist::detail
