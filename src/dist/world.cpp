// init_from_env and World: joining a job the way torchrun and gpipe-run
// describe it, over c10d's TCPStore and a process group (Gloo: gloo.cpp).

#include <c10/util/Exception.h>
#include <gpipe/dist.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "dist/backend.h"
#include "dist/connection.h"
#include "dist/meeting.h"
#include "dist/store_client.h"
#include "dist/world_env.h"
#include "engine/lane.h"
#include "text.h"

namespace gpipe::dist {

using detail::env;
using detail::env_int;

namespace {

// Note [Resolving MASTER_ADDR first]
// LibTorch 1.13's TCPStore client retries a host name that does not resolve
// once a second until its timeout, with a warning each time ("The IPv6
// network addresses of (HOST, PORT) cannot be retrieved"): a typo in
// MASTER_ADDR would read as a warning a second per rank for two minutes,
// then a timeout. The name is resolved here first, as c10d resolves it (any
// family, TCP), and refused at once when it cannot be; only a temporary
// failure (EAI_AGAIN: no answer from the resolver) is retried, quietly,
// until the timeout. A name that resolves never makes c10d warn: a refused
// connection (rank 0 not listening yet) is retried silently.
void check_master_addr(const char* addr, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  while (true) {
    addrinfo* found = nullptr;
    const int error = ::getaddrinfo(addr, nullptr, &hints, &found);
    const int system_error = errno;
    if (found != nullptr) {
      ::freeaddrinfo(found);
    }
    if (error == 0) {
      return;
    }
    TORCH_CHECK_VALUE(
        error == EAI_AGAIN,
        "gpipe::dist::init_from_env expects MASTER_ADDR to be a host name or "
        "address that resolves, but '",
        addr,
        "' does not (",
        error == EAI_SYSTEM ? std::strerror(system_error)
                            : ::gai_strerror(error),
        "); set MASTER_ADDR (gpipe-run --master-addr) to rank 0's host");
    const auto retry = std::chrono::seconds(1);
    TORCH_CHECK(
        std::chrono::steady_clock::now() + retry < deadline,
        "gpipe::dist::init_from_env could not resolve MASTER_ADDR '",
        addr,
        "' within ",
        timeout.count() / 1000.0,
        " s (",
        ::gai_strerror(error),
        "); check this host's resolver, or set MASTER_ADDR to rank 0's "
        "address");
    std::this_thread::sleep_for(retry);
  }
}

// Note [SIGPIPE]
// Gloo writes to its peers' sockets without MSG_NOSIGNAL on some paths: a
// write to a rank that has just died raises SIGPIPE, whose default action
// ends this process silently (exit 141) instead of failing the pass with
// an error that names the dead rank. A process that joins a job therefore
// ignores SIGPIPE, unless it has chosen a handler of its own: the write
// then fails with EPIPE, which Gloo reports.
void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 &&
      current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

bool is_available() {
  return true;
}

World init_from_env() {
  // Note [Errors without LibTorch's backtrace] in src/text.h.
  try {
    return init_from_env(default_timeout());
  } catch (const c10::Error& e) {
    gpipe::detail::rethrow_without_backtrace(e);
  }
}

namespace {

// Note [Knowing which ports this process hosts]
// The ports this process's rank-0 stores listen on, while a store lives: a
// World keeps its store, and a World that failed keeps it until the process
// exits (its group is kept: Gloo may still write into its receives). A new
// World on such a port would meet that store; it is told what holds the
// port instead. A World that closed cleanly retires its store rather than
// stopping it: the other ranks may still be finishing their last calls on
// it (the end of a save_checkpoint: rank 1 lost the store when rank 0,
// done first, stopped it), and c10d's server goes on serving them. A new
// World on the same port stops it first (the port is needed); the others
// stop once a new World's ranks have all met (the same processes, done with
// the old job), or when the process exits. So re-made Worlds neither pile
// up servers (a thread and sockets each) nor find their port held. (The
// stores are not watched through c10's weak pointers: a TCPStore with a
// weak pointer left is released but never destroyed.)
class OwnStores {
 public:
  // Returns the number that `retire(port, number, store)` takes back.
  uint64_t add(uint16_t port) {
    std::lock_guard<std::mutex> lock(mutex_);
    stores_[port] = ++added_;
    return added_;
  }
  void retire(
      uint16_t port, uint64_t number, c10::intrusive_ptr<c10d::Store> store) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = stores_.find(port);
    if (it != stores_.end() && it->second == number) {
      stores_.erase(it);
    }
    retired_.emplace_back(port, std::move(store));
  }
  // Stops the retired stores on `port`, or every one without it (outside
  // the lock: a server's thread ends).
  void stop_retired(std::optional<uint16_t> port = std::nullopt) {
    std::vector<c10::intrusive_ptr<c10d::Store>> stopping;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto kept = retired_.begin();
      for (auto& [on, store] : retired_) {
        if (!port || on == *port) {
          stopping.push_back(std::move(store));
        } else {
          *kept++ = {on, std::move(store)};
        }
      }
      retired_.erase(kept, retired_.end());
    }
    stopping.clear();
  }
  bool holds(uint16_t port) {
    std::lock_guard<std::mutex> lock(mutex_);
    return stores_.count(port) > 0;
  }

 private:
  std::mutex mutex_;
  std::map<uint16_t, uint64_t> stores_;
  std::vector<std::pair<uint16_t, c10::intrusive_ptr<c10d::Store>>> retired_;
  uint64_t added_ = 0;
};

OwnStores& own_stores() {
  static auto* stores = new OwnStores();  // never destroyed
  return *stores;
}

// A rank 0 whose port another process holds: tells that process, when it
// is the rank 0 of a job of `size` ranks waiting for the others, that a
// second rank 0 came (Note [A second rank 0] in dist/meeting.cpp). True
// when it did; a few seconds at most.
bool tell_the_holder(
    const char* addr,
    c10d::TCPStoreOptions options,
    const std::string& prefix,
    int64_t size) {
  options.isServer = false;
  options.numWorkers = c10::nullopt;
  options.timeout = std::min(options.timeout, std::chrono::milliseconds(3000));
  try {
    const detail::QuietLibTorchLog quiet;
    auto store = c10::make_intrusive<c10d::PrefixStore>(
        prefix,
        c10::make_intrusive<c10d::TCPStore>(std::string(addr), options));
    // Bounds every later reply (Note [Meeting within the timeout]).
    store->wait({}, options.timeout);
    return detail::tell_a_first_rank_0(store, size);
  } catch (const std::exception&) {
    return false;
  }
}

World join_from_env(std::chrono::milliseconds timeout) {
  // c10d's store counts its connect timeout in whole seconds: under one it
  // gives up at once, even for a job of one rank.
  TORCH_CHECK_VALUE(
      timeout >= std::chrono::seconds(1),
      "gpipe::dist::init_from_env expects a timeout of at least 1 s, but got ",
      timeout.count(),
      " ms");
  // So that c10d's threads keep what they free too (Note [Lanes and glibc's
  // malloc]).
  gpipe::detail::keep_freed_memory_once();
  ignore_sigpipe();  // Note [SIGPIPE]
  const char* addr = env("MASTER_ADDR");
  TORCH_CHECK_VALUE(
      addr != nullptr,
      "gpipe::dist::init_from_env needs the environment variable MASTER_ADDR "
      "(set by torchrun or gpipe-run), but it is not set or empty");
  const auto port = env_int("MASTER_PORT", 1, 65535);
  const auto size = env_int("WORLD_SIZE", 1, 1 << 20);
  const auto rank = env_int("RANK", 0, size - 1);
  const auto local_size = env_int("LOCAL_WORLD_SIZE", 1, size, size);
  const auto local_rank = env_int("LOCAL_RANK", 0, local_size - 1, rank);
  // See Note [Resolving MASTER_ADDR first].
  check_master_addr(addr, timeout);
  // A backend this build lacks is said before anyone waits.
  auto make_group =
      detail::backend_from_env(addr, local_rank, local_size, timeout);
  const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent != nullptr && (std::string(agent) == "True" ||
                                                std::string(agent) == "1");

  // See Note [Meeting within the timeout].
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto seconds = timeout.count() / 1000.0;
  // Note [Knowing which ports this process hosts].
  own_stores().stop_retired(static_cast<uint16_t>(port));
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  // torchrun's agent hosts the store itself; a second server on its port
  // would abort the process.
  options.isServer = rank == 0 && !agent_store;
  options.numWorkers =
      agent_store ? c10::nullopt : c10::optional<std::size_t>(size);
  options.waitWorkers = false;
  options.timeout = timeout;
  // Our own keys, apart from torchrun's and from an earlier attempt's after
  // an elastic restart.
  const char* attempt = env("TORCHELASTIC_RESTART_COUNT");
  const std::string prefix =
      std::string("gpipe/attempt_") + (attempt != nullptr ? attempt : "0");
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    // Note [c10d's lines on a failed connect] in dist/meeting.cpp.
    const detail::QuietLibTorchLog quiet;
    // c10d's client gives up on connecting early, when its next retry (a
    // second apart) would pass its timeout: a rank with a 3 s timeout gave
    // up after 2.5 s, and with 1 s a healthy job failed when rank 0's
    // store came a moment late. It tries again with what is left of the
    // deadline, then keeps the whole timeout for the store's later waits.
    while (true) {
      try {
        tcp = c10::make_intrusive<c10d::TCPStore>(std::string(addr), options);
        break;
      } catch (const std::exception&) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (options.isServer || left < std::chrono::milliseconds(50)) {
          throw;
        }
        // (With under a second left c10d gives up at once: not a spin.)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        options.timeout = left;
      }
    }
    options.timeout = timeout;
    tcp->setTimeout(timeout);
  } catch (const std::exception&) {
    const auto why = detail::message_of(std::current_exception());
    const bool held = options.isServer &&
                      why.find("Address already in use") != std::string::npos;
    TORCH_CHECK(
        !held || !own_stores().holds(options.port),
        "gpipe::dist::init_from_env: rank 0 cannot listen on port ",
        port,
        ": a World of this process holds it (a World that failed keeps its "
        "store until the process exits); give a new World in this process "
        "another MASTER_PORT");
    TORCH_CHECK(
        !held || !tell_the_holder(addr, options, prefix, size),
        "gpipe::dist::init_from_env: two processes came as RANK 0 of ",
        size,
        " (the other holds port ",
        port,
        "); give each process a RANK of its own (gpipe-run: another "
        "--node-rank on each host)");
    TORCH_CHECK(
        !held,
        "gpipe::dist::init_from_env: rank 0 cannot listen on port ",
        port,
        ": another process holds it (another job, or a second rank 0); "
        "choose another MASTER_PORT (gpipe-run --master-port) [c10d: ",
        why.substr(0, 300),
        "]");
    TORCH_CHECK(
        false,
        "gpipe::dist::init_from_env: rank ",
        rank,
        options.isServer ? " could not start the store at "
                         : " could not reach rank 0's store at ",
        addr,
        ":",
        port,
        " within ",
        seconds,
        " s",
        // c10d's own timeout is its last try's, counted from another
        // start ("timed out after 0s"): ours says when.
        why.find("timed out") != std::string::npos
            ? std::string()
            : " [c10d: " + why.substr(0, 300) + "]");
  }
  if (options.isServer) {
    const auto number = own_stores().add(options.port);
    tcp = c10::make_intrusive<detail::HostedStore>(
        std::move(tcp),
        [port = options.port, number](c10::intrusive_ptr<c10d::Store> inner) {
          own_stores().retire(port, number, std::move(inner));
        });
  } else {
    // Note [Letting go of a store whose host ended] in store_client.h.
    tcp = c10::make_intrusive<detail::StoreClient>(
        std::move(tcp), c10::str(addr, ":", port));
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
  detail::meet(
      store,
      rank,
      size,
      c10::str(addr, ":", port),
      deadline,
      timeout,
      options.isServer);
  // Every rank of the new World came: done with older ones' stores.
  own_stores().stop_retired();
  auto groups = make_group(store, rank, size);
  return World(std::make_shared<detail::Connection>(
      store,
      std::move(groups),
      rank,
      size,
      local_rank,
      local_size,
      timeout,
      std::move(make_group)));
}

}  // namespace

World init_from_env(std::chrono::milliseconds timeout) {
  // Note [Errors without LibTorch's backtrace] in src/text.h.
  try {
    return join_from_env(timeout);
  } catch (const c10::Error& e) {
    gpipe::detail::rethrow_without_backtrace(e);
  }
}

namespace {

World join_store(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(
      store, "gpipe::dist::init_from_store expects a store, but got none");
  TORCH_CHECK_VALUE(
      size >= 1 && rank >= 0 && rank < size,
      "gpipe::dist::init_from_store expects 0 <= rank < size, but got rank ",
      rank,
      " and size ",
      size);
  TORCH_CHECK_VALUE(
      timeout.count() > 0,
      "gpipe::dist::init_from_store expects a positive timeout, but got ",
      timeout.count(),
      " ms");
  gpipe::detail::keep_freed_memory_once();
  ignore_sigpipe();  // Note [SIGPIPE]
  const char* addr = env("MASTER_ADDR");
  // Every rank of the store is a thread of this process.
  auto make_group = detail::backend_from_env(
      addr != nullptr ? addr : "127.0.0.1", rank, size, timeout);
  // Note [Worlds one after another on one store]
  // A job may make a World again on the store of an earlier one (after an
  // error, or a test of several Worlds). Under the same keys, the new
  // World's Gloo groups met the old addresses and hung for the timeout, and
  // its failure notices named the ranks that had left the old one. So each
  // World's keys are apart: a rank's nth World on a store takes the nth
  // prefix, counted in the store itself, as every rank makes its Worlds in
  // the same order.
  const auto nth =
      store->add("gpipe/worlds_of_rank_" + std::to_string(rank), 1);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
      "gpipe/world_" + std::to_string(nth) + "/", store);
  auto groups = make_group(prefixed, rank, size);
  return World(std::make_shared<detail::Connection>(
      prefixed,
      std::move(groups),
      rank,
      size,
      /*local_rank=*/rank,
      /*local_size=*/size,
      timeout,
      std::move(make_group)));
}

}  // namespace

World init_from_store(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    std::chrono::milliseconds timeout) {
  // Note [Errors without LibTorch's backtrace] in src/text.h.
  try {
    return join_store(std::move(store), rank, size, timeout);
  } catch (const c10::Error& e) {
    gpipe::detail::rethrow_without_backtrace(e);
  }
}

World::World(std::shared_ptr<detail::Connection> connection)
    : connection_(std::move(connection)) {
  TORCH_CHECK_VALUE(
      connection_ != nullptr, "gpipe::dist::World needs a connection");
}

World::~World() = default;

int64_t World::rank() const {
  return connection_->rank;
}
int64_t World::size() const {
  return connection_->size;
}
int64_t World::local_rank() const {
  return connection_->local_rank;
}
int64_t World::local_size() const {
  return connection_->local_size;
}
std::chrono::milliseconds World::timeout() const {
  return connection_->timeout;
}
const c10::intrusive_ptr<c10d::ProcessGroup>& World::group() const {
  return connection_->group;
}
const c10::intrusive_ptr<c10d::Store>& World::store() const {
  return connection_->store;
}

}  // namespace gpipe::dist
