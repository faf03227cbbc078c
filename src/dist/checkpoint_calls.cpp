// The store protocol of a distributed checkpoint call: see
// dist/checkpoint_calls.h.

#include "dist/checkpoint_calls.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dist/agreement.h"
#include "dist/connection.h"
#include "text.h"

namespace gpipe::dist::detail {

// The store's bytes as a string, and back.
std::vector<uint8_t> store_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}
std::string store_text(const std::vector<uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

// Results travel through the store as "ok:<value>" or
// "error:<kind>:<message>", the kind of c10::Error as refusal_kind_of
// numbers it, so that another rank's ValueError is one here too.
std::string result_ok(const std::string& value) {
  return "ok:" + value;
}
std::string result_failed(const std::string& message, int64_t kind) {
  return "error:" + std::to_string(kind) + ":" + message;
}
std::string result_failed(const std::exception_ptr& error) {
  return result_failed(
      detail::message_of(error), detail::refusal_kind_of(error));
}
bool result_is_ok(const std::string& result) {
  return result.rfind("ok:", 0) == 0;
}
std::string result_value(const std::string& result) {
  if (result_is_ok(result)) {
    return result.substr(3);
  }
  return result.substr(result.find(':', 6) + 1);
}
int64_t result_kind(const std::string& result) {
  return result_is_ok(result) ? 0 : std::atoll(result.c_str() + 6);
}
// Throws a failed result's error with its kind, `context` before it.
void check_result(const std::string& result, const std::string& context) {
  if (!result_is_ok(result)) {
    std::rethrow_exception(detail::refusal_error(
        result_kind(result), context + ": " + result_value(result)));
  }
}

// Note [Checkpoint calls within the timeout]
// Every rank of the World calls save_checkpoint or load_checkpoint at once,
// and they talk through the World's store. A wait for another rank's word
// is bounded by the World's timeout (a HashStore waits 300 s by default,
// whatever the World's is: so is a whole save, its writing included) and
// names the rank waited for; a rank that gives up says so in the store, and
// the others, which look for it while they wait, give up at once rather
// than wait out a timeout of their own. A World that failed meanwhile ends
// the wait with its failure. Every rank removes the call's keys, on every
// path, once all are past them (ForgetCallKeys). Before anything
// else the ranks say which call they make, and with what (a save's step and
// optimizer kind): a rank that calls load while another saves, or saves
// with another optimizer (which would write a manifest that names one kind
// over another's state, loadable by neither), fails every rank at once
// with a c10::ValueError naming both sides, and nothing is written.

// The value of `key`, which `from` sets, once it is there; `prefix` is the
// call's (see the Note).
std::string read_within_timeout(
    const World& world,
    const std::string& prefix,
    const std::string& key,
    int64_t from,
    const char* what) {
  using Clock = std::chrono::steady_clock;
  auto& store = *world.store();
  const auto& connection = *world.connection();
  const auto gave_up = prefix + "gave_up";
  // Rank 0 waits for the others and then says what it found: the others
  // wait for rank 0 a little longer, so that a rank that never came is
  // named by rank 0 (through gave_up), not rank 0 by them.
  const auto grace = from == 0 && world.rank() != 0
                         ? std::min<std::chrono::milliseconds>(
                               connection.timeout, std::chrono::seconds(5))
                         : std::chrono::milliseconds(0);
  const auto deadline = Clock::now() + connection.timeout + grace;
  // Polled with check, which answers at once: a TCPStore's wait that times
  // out leaves its answer on the socket, for the next request to read.
  constexpr auto kPoll = std::chrono::milliseconds(20);
  while (true) {
    bool there = false;
    try {
      there = store.check({key});
    } catch (const std::exception&) {
      connection.check();  // the World's failure, when it failed meanwhile
      gpipe::detail::fail_without_backtrace(c10::str(
          "gpipe::dist::",
          what,
          ": ",
          connection.rank_name(world.rank()),
          " lost the job's store while it waited for ",
          connection.rank_name(from),
          " (rank 0, which hosts it, ended or stopped answering) [c10d: ",
          detail::message_of(std::current_exception()).substr(0, 200),
          "]"));
    }
    if (there) {
      return store_text(store.get(key));
    }
    connection.check();
    if (store.check({gave_up})) {
      gpipe::detail::fail_without_backtrace(c10::str(
          "gpipe::dist::",
          what,
          ": ",
          store_text(store.get(gave_up)),
          "; ",
          connection.rank_name(world.rank()),
          " gave up too"));
    }
    if (Clock::now() >= deadline) {
      break;
    }
    std::this_thread::sleep_for(kPoll);
  }
  // A rank that said which call it makes had reached it, and then ended
  // (killed) or stalled in it; one that did not say had not reached it.
  // Every wait but agree_on_call's own comes after every rank said it (this
  // one read it there): asking the store again named a rank killed while
  // it wrote its part as one that had not reached the call.
  const auto call_key = prefix + "call" + std::to_string(from);
  bool reached = key != call_key;
  if (!reached) {
    try {
      reached = store.check({call_key});
    } catch (const std::exception&) {
    }
  }
  // Of the ranks that had not, every one (not only the first waited for).
  std::string absent = connection.rank_name(from);
  if (!reached) {
    std::vector<int64_t> ranks;
    for (const auto r : c10::irange(world.size())) {
      try {
        if (r == from ||
            (r != world.rank() &&
             !store.check({prefix + "call" + std::to_string(r)}))) {
          ranks.push_back(r);
        }
      } catch (const std::exception&) {
        ranks = {from};
        break;
      }
    }
    absent = connection.rank_names(ranks);
  }
  const auto message =
      reached
          ? c10::str(
                connection.rank_name(world.rank()),
                " waited ",
                (connection.timeout + grace).count() / 1000.0,
                " s for ",
                connection.rank_name(from),
                ", which had begun ",
                what,
                " but did not finish its part: its process ended (killed?) or "
                "stalled")
          : c10::str(
                connection.rank_name(world.rank()),
                " waited ",
                (connection.timeout + grace).count() / 1000.0,
                " s for ",
                absent,
                ", which had not reached it (every rank calls ",
                what,
                " together, between steps)");
  try {
    store.compareSet(gave_up, {}, store_bytes(message));
  } catch (const std::exception&) {
    // (No store to tell: the others find that out themselves.)
  }
  gpipe::detail::fail_without_backtrace(
      c10::str("gpipe::dist::", what, ": ", message));
}

// Every rank says which call it makes (`call`: its name and arguments, as
// "what step=5 optimizer=Adam"); each returns when all have said, or
// throws on every rank the first that differs from rank 0's.
void agree_on_call(
    const World& world,
    const std::string& prefix,
    const char* what,
    const std::string& call) {
  world.store()->set(
      prefix + "call" + std::to_string(world.rank()), store_bytes(call));
  const auto first =
      read_within_timeout(world, prefix, prefix + "call0", 0, what);
  for (const auto r : c10::irange(int64_t{1}, world.size())) {
    const auto theirs = read_within_timeout(
        world, prefix, prefix + "call" + std::to_string(r), r, what);
    const auto& connection = *world.connection();
    TORCH_CHECK_VALUE(
        theirs == first,
        "gpipe::dist::",
        what,
        ": ",
        connection.rank_name(r),
        " called ",
        theirs,
        " but ",
        connection.rank_name(0),
        " called ",
        first,
        "; every rank calls the same checkpoint function at once, with the "
        "same step and the same kind of optimizer. Nothing was written or "
        "loaded");
  }
}

// Every rank says how it fared (`error` empty when it did); each returns
// when all have said, throwing the first failing rank's error on every
// rank.
void agree_on_outcome(
    const World& world,
    const std::string& prefix,
    const char* what,
    const std::string& error) {
  auto& store = *world.store();
  store.set(
      prefix + "rank" + std::to_string(world.rank()),
      store_bytes(error.empty() ? result_ok("") : result_failed(error)));
  for (const auto r : c10::irange(world.size())) {
    const auto result = read_within_timeout(
        world, prefix, prefix + "rank" + std::to_string(r), r, what);
    TORCH_CHECK_VALUE(
        result_is_ok(result),
        "gpipe::dist::",
        what,
        ": rank ",
        r,
        " failed: ",
        result_value(result));
  }
}

ForgetCallKeys::~ForgetCallKeys() {
  try {
    auto& store = *world_.store();
    if (store.add(prefix_ + "past", 1) != world_.size()) {
      return;
    }
    std::vector<std::string> keys{"tmp", "done", "path", "gave_up", "past"};
    for (const auto r : c10::irange(world_.size())) {
      for (const char* each : {"call", "part", "buffers", "rank"}) {
        keys.push_back(each + std::to_string(r));
      }
    }
    for (const auto& key : keys) {
      store.deleteKey(prefix_ + key);  // (false when it was never set)
    }
  } catch (const std::exception&) {
    // A store that is gone keeps nothing.
  }
}

std::string call_prefix(const World& world) {
  return "checkpoint/" + std::to_string(world.connection()->next_stage_id()) +
         "/";
}

void with_c10_errors(
    const World& world, const char* what, const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    world.connection()->check();
    gpipe::detail::fail_without_backtrace(c10::str(
        "gpipe::dist::",
        what,
        ": ",
        world.connection()->rank_name(world.rank()),
        " lost the job's store (rank 0, which hosts it, ended or stopped "
        "answering) [c10d: ",
        std::string(e.what()).substr(0, 200),
        "]"));
  }
}

}  // namespace gpipe::dist::detail
