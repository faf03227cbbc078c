#pragma once

// How the ranks of a distributed checkpoint call (gpipe::dist::
// save_checkpoint, load_checkpoint) talk through the World's store: each
// rank's results, waits bounded by the World's timeout, the agreement on
// which call every rank makes, and the call's keys removed once every rank
// is past them (Note [Checkpoint calls within the timeout] in
// dist/checkpoint_calls.cpp).

#include <gpipe/dist.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace gpipe::dist::detail {

/// Text as the store's bytes, and back.
std::vector<uint8_t> store_bytes(const std::string& s);
std::string store_text(const std::vector<uint8_t>& b);

/// A rank's result as it travels through the store: "ok:<value>" or
/// "error:<kind>:<message>", the kind of c10::Error as refusal_kind_of
/// numbers it, so that another rank's ValueError is one on every rank.
std::string result_ok(const std::string& value);
std::string result_failed(const std::string& message, int64_t kind = 0);
std::string result_failed(const std::exception_ptr& error);
bool result_is_ok(const std::string& result);
/// The value or the message.
std::string result_value(const std::string& result);
/// The error's kind (0 for a plain c10::Error, and for an ok result).
int64_t result_kind(const std::string& result);
/// Throws a failed result's error with its kind, `context` before it.
void check_result(const std::string& result, const std::string& context);

/// The value of `key`, which rank `from` sets, once it is there; `prefix`
/// is the call's. Waits at most the World's timeout (rank 0's words a
/// little longer), gives up at once when another rank gave up or the
/// World failed, and throws a c10::Error naming the rank waited for.
std::string read_within_timeout(
    const World& world,
    const std::string& prefix,
    const std::string& key,
    int64_t from,
    const char* what);

/// Every rank says which call it makes (`call`: its name and arguments, as
/// "save_checkpoint(step 5, optimizer Adam)"); returns when all have said,
/// or throws a c10::ValueError on every rank naming the first that differs
/// from rank 0's.
void agree_on_call(
    const World& world,
    const std::string& prefix,
    const char* what,
    const std::string& call);

/// Every rank says how it fared (`error` empty when it did); returns when
/// all have said, throwing the first failing rank's error on every rank.
void agree_on_outcome(
    const World& world,
    const std::string& prefix,
    const char* what,
    const std::string& error);

/// A prefix of store keys that no other collective of `world` uses (the
/// same for a save and a load, so that ranks that call one each meet).
std::string call_prefix(const World& world);

/// Made when a call begins: once every rank is past the call's keys (its
/// destructor runs on every path out of it, a failure's too), the last one
/// removes them from the store, so that a long run's checkpoints do not
/// pile up there.
class ForgetCallKeys {
 public:
  ForgetCallKeys(World world, std::string prefix)
      : world_(std::move(world)), prefix_(std::move(prefix)) {}
  ForgetCallKeys(const ForgetCallKeys&) = delete;
  ForgetCallKeys& operator=(const ForgetCallKeys&) = delete;
  ~ForgetCallKeys();

 private:
  World world_;
  std::string prefix_;
};

/// Runs `call`: an error of the store's that is not a c10::Error (a
/// std::system_error, "Broken pipe", when rank 0 ended in the middle of
/// it) becomes one, naming `what`, or the World's own failure when it
/// failed meanwhile.
void with_c10_errors(
    const World& world, const char* what, const std::function<void()>& call);

}  // namespace gpipe::dist::detail
