// Gloo process groups: the one file that knows how a Gloo group is made
// (see Note [Backends] in dist/backend.h).

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "dist/backend.h"
#include "dist/ordered_channel.h"
#include "dist/process_group.h"

#if defined(__linux__)
#include <sched.h>
#include <sys/resource.h>
#endif

namespace gpipe::dist::detail {

// Note [Gloo's event loop on shared cores]
// Gloo's TCP device has one thread of its own, an event loop over every
// pair's socket. When a host has more ranks than CPUs, that loop costs the
// lanes their cores twice over (docs/benchmark-history.md, "Where four
// ranks on two cores lose their time"). A lane's write to a pair's socket
// wakes the peer's loop thread, which preempts the lane, on that core,
// while the lane still holds the pair's lock. The lane's own loop thread
// then spins: its level-triggered epoll reports the busy pair again at
// once, and its handler skips a pair it cannot lock. On such a host, the
// device is made by a short-lived thread that first lowers its own
// priority to nice 19, and the loop thread inherits that priority (Linux
// gives a new thread its creator's nice value). So a woken loop thread no
// longer preempts a lane, and a spinning one gets about 1/70 of a core
// that lanes want. With a CPU for each rank, the default stays 0: there,
// BLAS threads that fill the cores would keep a low-priority loop thread
// waiting for a scheduler tick at every message. What it changed, and what
// it costs a message: docs/benchmark-history.md, "Gloo's event loop below
// the lanes". GPIPE_GLOO_LOOP_NICE (0 to 19) sets the value either way.

int64_t usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max<int64_t>(1, CPU_COUNT(&set));
  }
#endif
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

int gloo_loop_nice(int64_t local_ranks, int64_t cpus, const char* setting) {
  if (setting != nullptr && *setting != '\0') {
    const std::string text(setting);
    char* end = nullptr;
    const long value = std::strtol(text.c_str(), &end, 10);
    TORCH_CHECK_VALUE(
        std::isdigit(static_cast<unsigned char>(text.front())) &&
            end == text.c_str() + text.size() && value <= 19,
        "gpipe::dist expects GPIPE_GLOO_LOOP_NICE to be a whole number from "
        "0 to 19 (the nice value of Gloo's event-loop thread), but got '",
        text,
        "'");
    return static_cast<int>(value);
  }
  return local_ranks > cpus ? 19 : 0;
}

namespace {

// Runs `make` on a thread of its own at nice `nice`: the threads it starts
// inherit that priority, and the caller's stays as it is.
std::shared_ptr<::gloo::transport::Device> made_at_nice(
    int nice,
    const std::function<std::shared_ptr<::gloo::transport::Device>()>& make) {
  if (nice == 0) {
    return make();
  }
  std::shared_ptr<::gloo::transport::Device> device;
  std::exception_ptr error;
  std::thread maker([&] {
#if defined(__linux__)
    // Raising one's nice value needs no privilege; if it fails anyway
    // (seccomp), the device is made at the default priority.
    (void)setpriority(PRIO_PROCESS, 0, nice);
#endif
    try {
      device = make();
    } catch (...) {
      error = std::current_exception();
    }
  });
  maker.join();
  if (error) {
    std::rethrow_exception(error);
  }
  return device;
}

}  // namespace

GroupFactory gloo_groups(
    const std::string& master_addr,
    std::chrono::milliseconds timeout,
    GlooChannel channel,
    int64_t local_ranks) {
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  const int nice = gloo_loop_nice(
      local_ranks, usable_cpus(), std::getenv("GPIPE_GLOO_LOOP_NICE"));
  auto device = made_at_nice(nice, [&] {
    if (iface != nullptr && *iface != '\0') {
      return c10d::ProcessGroupGloo::createDeviceForInterface(iface);
    }
    if (master_addr == "127.0.0.1" || master_addr == "localhost") {
      // Everyone is on this host.
      return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    }
    return c10d::ProcessGroupGloo::createDefaultDevice();
  });
  return [device, timeout, channel](
             const c10::intrusive_ptr<c10d::Store>& store,
             int64_t rank,
             int64_t size) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(device);
    c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;
    try {
      backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          store, static_cast<int>(rank), static_cast<int>(size), options);
    } catch (const std::exception& e) {
      std::string what = e.what();
      // c10d's message, without LibTorch's backtrace.
      if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
        what = error->what_without_backtrace();
      }
      TORCH_CHECK(
          false,
          "gpipe::dist: rank ",
          rank,
          " of ",
          size,
          " could not connect to the other ranks within ",
          timeout.count() / 1000.0,
          " s [c10d: ",
          what.substr(0, 300),
          "]");
    }
#if TORCH_VERSION_MAJOR >= 2
    const auto type = c10d::ProcessGroup::BackendType::GLOO;
#else
    const int type = 0;
#endif
    Groups groups;
    groups.group = as_process_group(
        std::move(backend), store, rank, size, c10::kCPU, type, "gloo");
    if (channel == GlooChannel::Tagged) {
      groups.channel = tagged_channel(groups.group);
    } else {
      // A Gloo work ends when waited for, and its abort ends the wait: the
      // channel aborts the receive its reader waits in, and a send to a
      // rank that is gone fails by itself.
      groups.channel = ordered_channel(
          store,
          rank,
          size,
          c10::Device(c10::kCPU),
          [device, timeout](
              const c10::intrusive_ptr<c10d::Store>& pair_store,
              int64_t pair_rank) -> c10::intrusive_ptr<PairGroup> {
            auto pair_options =
                c10d::ProcessGroupGloo::Options::create(timeout);
            pair_options->devices.push_back(device);
            return c10::make_intrusive<c10d::ProcessGroupGloo>(
                pair_store, static_cast<int>(pair_rank), 2, pair_options);
          },
          [](PairGroup& /*group*/) {},
          /*poll=*/false);
    }
    groups.device = c10::Device(c10::kCPU);
    return groups;
  };
}

}  // namespace gpipe::dist::detail
